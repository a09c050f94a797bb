// Registration functions for xlakit._C, one per area (bind_*.cc), called
// from module.cc. These bind only the dependency-free core in core/ (and the
// PJRT wrapper's environment names).
#ifndef XLAKIT_BINDINGS_H_
#define XLAKIT_BINDINGS_H_

#include <pybind11/pybind11.h>

namespace xlakit {

void BindCache(pybind11::module_& m);
void BindTransfer(pybind11::module_& m);
void BindDevice(pybind11::module_& m);
void BindTrust(pybind11::module_& m);
void BindPjrtWrap(pybind11::module_& m);

}  // namespace xlakit

#endif  // XLAKIT_BINDINGS_H_
