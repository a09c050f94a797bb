// Python bindings for runtime device string validation.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <tuple>
#include <vector>

#include "bindings.h"
#include "core/device_string.h"

namespace py = pybind11;

namespace xlakit {

void BindDevice(py::module_& m) {
  m.def(
      "validate_runtime_device",
      [](const std::string& device, const std::vector<std::string>& known,
         bool allow_virtual) {
        RuntimeDevice parsed;
        std::string error =
            ValidateRuntimeDevice(device, known, allow_virtual, &parsed);
        if (!error.empty()) throw py::value_error(error);
        return std::make_tuple(parsed.platform, parsed.ordinal,
                               parsed.is_virtual);
      },
      py::arg("device"), py::arg("known"), py::kw_only(),
      py::arg("allow_virtual") = true);
}

}  // namespace xlakit
