// xlakit cxx-check shim, declarations only: stands in for openxla's
// xla/python/profiler/internal/traceme_wrapper.h, which the TensorFlow
// wheels do not ship (they carry its nanobind successor, not this pybind11
// class). It declares the members init_python_bindings.cpp binds; never
// linked.
#ifndef XLAKIT_SHIM_TRACEME_WRAPPER_H_
#define XLAKIT_SHIM_TRACEME_WRAPPER_H_

#include <pybind11/pybind11.h>

#include "tsl/profiler/lib/traceme.h"

namespace xla {
namespace profiler {

class TraceMeWrapper {
 public:
  TraceMeWrapper(const pybind11::str& name, const pybind11::kwargs& kwargs);
  void SetMetadata(const pybind11::kwargs& kwargs);
  void Stop();
  static bool IsEnabled();
};

}  // namespace profiler
}  // namespace xla

#endif  // XLAKIT_SHIM_TRACEME_WRAPPER_H_
