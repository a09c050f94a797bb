// Python bindings for runtime device string validation.
// Python.h (through bindings.h) comes first, as CPython requires.
#include "bindings.h"

#include <string>
#include <vector>

#include "core/device_string.h"

namespace xlakit {
namespace {

py::Ref ValidateDevice(PyObject* args, PyObject* kwargs) {
  static const char* kNames[] = {"device", "known", "allow_virtual", nullptr};
  PyObject *device = nullptr, *known = nullptr, *allow_virtual = nullptr;
  py::Parse(args, kwargs, "OO|$O", kNames, &device, &known, &allow_virtual);
  RuntimeDevice parsed;
  std::string error = ValidateRuntimeDevice(
      py::String(device, "device"), py::StringList(known, "known"),
      py::Truth(allow_virtual, true), &parsed);
  if (!error.empty()) py::Raise(PyExc_ValueError, error);
  return py::Tuple(py::Text(parsed.platform), py::Int(parsed.ordinal),
                   py::Bool(parsed.is_virtual));
}

PyMethodDef kMethods[] = {
    py::Method<ValidateDevice>(
        "validate_runtime_device",
        "validate_runtime_device(device, known, *, allow_virtual=True) -> "
        "(platform, ordinal, is_virtual); ValueError naming the valid devices"),
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void BindDevice(PyObject* m) { py::AddFunctions(m, kMethods); }

}  // namespace xlakit
