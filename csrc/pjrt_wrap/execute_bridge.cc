// See execute_bridge.h.
#include "pjrt_wrap/execute_bridge.h"

#include <cstring>
#include <string>

#include "pjrt_wrap/counters.h"

namespace xlakit {
namespace pjrt_wrap {

PJRT_Error* ExecuteWithBridge(const PJRT_Api* real,
                              PJRT_LoadedExecutable_Execute_Args* args) {
  PJRT_ExecuteOptions* given = args ? args->options : nullptr;
  if (given == nullptr || given->struct_size >= PJRT_ExecuteOptions_STRUCT_SIZE) {
    return real->PJRT_LoadedExecutable_Execute(args);
  }
  const int minor = real->pjrt_api_version.minor_version;
  if (minor > kBridgeTestedUpToMinor) {
    try {
      LogOnce("bridge",
              "the framework passes a " + std::to_string(given->struct_size) +
                  "-byte PJRT_ExecuteOptions; not padded for a plugin of C "
                  "API 0." + std::to_string(minor) +
                  " (padding is tested up to 0." +
                  std::to_string(kBridgeTestedUpToMinor) +
                  "): use a plugin built for the framework's C API");
    } catch (...) {  // no memory for the message: the call goes on unpadded
    }
    return real->PJRT_LoadedExecutable_Execute(args);
  }
  PJRT_ExecuteOptions padded;
  std::memset(&padded, 0, sizeof(padded));
  std::memcpy(&padded, given, given->struct_size);
  padded.struct_size = PJRT_ExecuteOptions_STRUCT_SIZE;
  ++GlobalCounters().execute_options_padded;
  // The caller's arguments are used as they are (they may be larger than this
  // header knows), with only the options pointer swapped for the call.
  args->options = &padded;
  PJRT_Error* error = real->PJRT_LoadedExecutable_Execute(args);
  args->options = given;
  return error;
}

}  // namespace pjrt_wrap
}  // namespace xlakit
