// Typed calls into the real plugin's PJRT_Api for what the wrapper itself
// asks of it: names, devices, serialize, deserialize, destroy. Each returns
// false with the plugin's error message (the PJRT_Error destroyed here) so
// the cache can count it and fall back; nothing throws.
//
// Argument structs are this header's (the pinned pjrt_c_api.h): a plugin of
// an older minor reads the fields it knows, a newer one accepts them as long
// as the struct did not grow (the structs used here have not since C API
// 0.80; a plugin that refuses one is a counted cache failure, never a failed
// compile).
#ifndef XLAKIT_PJRT_WRAP_PJRT_CALLS_H_
#define XLAKIT_PJRT_WRAP_PJRT_CALLS_H_

#include <cstddef>
#include <string>
#include <string_view>

#include "xla/pjrt/c/pjrt_c_api.h"

namespace xlakit {
namespace pjrt_wrap {

// Whether the plugin's table has the function at `offset` (its struct_size
// reaches it and it is set).
bool HasFunction(const PJRT_Api* api, size_t offset, size_t size);
#define XLAKIT_PJRT_HAS(api, field)                         \
  ::xlakit::pjrt_wrap::HasFunction(api, offsetof(PJRT_Api, field), \
                                   sizeof(((PJRT_Api*)0)->field))

// The error's message and code, "" for nullptr; destroys the error.
std::string TakeError(const PJRT_Api* api, PJRT_Error* error);

bool PlatformName(const PJRT_Api* api, PJRT_Client* client, std::string* out,
                  std::string* error);
bool PlatformVersion(const PJRT_Api* api, PJRT_Client* client,
                     std::string* out, std::string* error);

// The client's own process index, then every device the client knows (all
// processes), one line each: id, process index, kind and the plugin's
// description; the topology an executable is compiled for beyond its device
// assignment. The process index keeps hosts of a pod apart: an executable is
// loaded only by the process (host) that compiled it.
bool DescribeDevices(const PJRT_Api* api, PJRT_Client* client,
                     std::string* out, std::string* error);

// The executable's serialized form (PJRT_Executable_Serialize of its
// PJRT_Executable), copied out.
bool SerializeExecutable(const PJRT_Api* api, PJRT_LoadedExecutable* loaded,
                         std::string* out, std::string* error);

bool DeserializeAndLoad(const PJRT_Api* api, PJRT_Client* client,
                        std::string_view serialized,
                        PJRT_LoadedExecutable** out, std::string* error);

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_PJRT_CALLS_H_
