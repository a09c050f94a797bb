// Runtime device string validation; see device_string.h.
#include "device_string.h"

#include <algorithm>
#include <cctype>

namespace xlakit {
namespace {

std::string Join(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& s : items) {
    if (!out.empty()) out += ", ";
    out += s;
  }
  return out.empty() ? "(none)" : out;
}

}  // namespace

std::string ParseRuntimeDevice(const std::string& device, RuntimeDevice* out) {
  size_t colon = device.find(':');
  std::string why;
  if (colon == std::string::npos || colon == 0 || colon + 1 == device.size()) {
    why = "expected PLATFORM:ORDINAL";
  } else {
    for (size_t i = 0; i < colon && why.empty(); ++i) {
      unsigned char c = device[i];
      if (!(std::isupper(c) || std::isdigit(c) || c == '_')) {
        why = "the platform must be upper case as the runtime spells it";
      }
    }
    for (size_t i = colon + 1; i < device.size() && why.empty(); ++i) {
      if (!std::isdigit(static_cast<unsigned char>(device[i]))) {
        why = "the ordinal must be a non-negative decimal number";
      }
    }
    if (why.empty() && device.size() - colon - 1 > 9) {
      why = "the ordinal is out of range";
    }
  }
  if (!why.empty()) {
    return "'" + device + "' is not a runtime device string: " + why +
           ", like 'TPU:0' (see torch_xla._XLAC._xla_get_runtime_devices())";
  }
  out->platform = device.substr(0, colon);
  out->ordinal = std::stoll(device.substr(colon + 1));
  out->is_virtual = out->platform == kSpmdPlatform;
  return "";
}

std::string ValidateRuntimeDevice(const std::string& device,
                                  const std::vector<std::string>& known,
                                  bool allow_virtual, RuntimeDevice* out) {
  std::string error = ParseRuntimeDevice(device, out);
  if (!error.empty()) {
    return error + "; valid devices: " + Join(known);
  }
  if (out->is_virtual) {
    if (allow_virtual && out->ordinal == 0) return "";
    return "'" + device + "' is the SPMD virtual device, which " +
           (allow_virtual ? "only exists as SPMD:0" : "is not accepted here") +
           "; valid devices: " + Join(known);
  }
  if (std::find(known.begin(), known.end(), device) == known.end()) {
    return "unknown device '" + device + "': this process has " + Join(known);
  }
  return "";
}

}  // namespace xlakit
