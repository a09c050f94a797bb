// Registration functions for xlakit._C, one per area (bind_*.cc), called
// from module.cc. These bind only the dependency-free core in core/ (and the
// PJRT wrapper's environment names), over the limited API (py_api.h). Each
// throws py::ErrorSet with a Python exception set when registration fails.
#ifndef XLAKIT_BINDINGS_H_
#define XLAKIT_BINDINGS_H_

#include "py_api.h"

namespace xlakit {

void BindCache(PyObject* m);
void BindTransfer(PyObject* m);
void BindDevice(PyObject* m);
void BindTrust(PyObject* m);
void BindPjrtWrap(PyObject* m);

}  // namespace xlakit

#endif  // XLAKIT_BINDINGS_H_
