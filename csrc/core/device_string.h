// Runtime device strings ("TPU:3", "CPU:0", the SPMD virtual "SPMD:0"):
// parsing and validation against the devices a process actually has, with
// messages that list the valid choices. No XLA or torch headers: also
// compiled into xlakit._C and tested there.
#ifndef XLAKIT_CORE_DEVICE_STRING_H_
#define XLAKIT_CORE_DEVICE_STRING_H_

#include <cstdint>
#include <string>
#include <vector>

namespace xlakit {

inline constexpr char kSpmdPlatform[] = "SPMD";

struct RuntimeDevice {
  std::string platform;  // upper case, e.g. "TPU"
  int64_t ordinal = 0;
  // "SPMD:0": the virtual device that stands for all local devices.
  bool is_virtual = false;
};

// Parses "PLATFORM:ORDINAL" exactly as the runtime spells it (upper-case
// platform, decimal ordinal, no spaces). Returns "" or a message.
std::string ParseRuntimeDevice(const std::string& device, RuntimeDevice* out);

// Parses `device` and checks that it is one of `known` (the strings
// `_xla_get_runtime_devices()` returns) or the SPMD virtual device when
// `allow_virtual`. The message lists the valid devices. Returns "" on success.
std::string ValidateRuntimeDevice(const std::string& device,
                                  const std::vector<std::string>& known,
                                  bool allow_virtual, RuntimeDevice* out);

}  // namespace xlakit

#endif  // XLAKIT_CORE_DEVICE_STRING_H_
