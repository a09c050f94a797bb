// xlakit._C: the dependency-free C++ core that the torch_xla patches also
// compile in, exposed to Python so it is tested (and used by `xlakit cache`)
// without a patched torch_xla.
#include <pybind11/pybind11.h>

#include "bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "xlakit's C++ core (cache envelope and folder trust, transfer planning, devices)";
  xlakit::BindCache(m);
  xlakit::BindTransfer(m);
  xlakit::BindDevice(m);
  xlakit::BindTrust(m);
  xlakit::BindPjrtWrap(m);
}
