// xlakit._C: the dependency-free C++ core that the torch_xla patches also
// compile in, exposed to Python so it is tested (and used by `xlakit cache`)
// without a patched torch_xla. Built against the limited API, so one
// `_C.abi3.so` serves every supported Python.
#include "bindings.h"

namespace {

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "xlakit's C++ core (cache envelope and folder trust, transfer planning, "
    "devices)",
    -1,       // m_size: no per-module state
    nullptr,  // m_methods: added by each Bind*()
    nullptr,  // m_slots
    nullptr,  // m_traverse
    nullptr,  // m_clear
    nullptr,  // m_free
};

}  // namespace

PyMODINIT_FUNC PyInit__C() {
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  PyObject* done = xlakit::py::Guard([m] {
    xlakit::BindCache(m);
    xlakit::BindTransfer(m);
    xlakit::BindDevice(m);
    xlakit::BindTrust(m);
    xlakit::BindPjrtWrap(m);
    return xlakit::py::Ref::Borrow(m);
  });
  Py_DECREF(m);  // `done` holds the module, or is NULL with the error set
  return done;
}
