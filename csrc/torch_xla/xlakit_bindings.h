// Registers xlakit's torch_xla._XLAC bindings (_xla_runtime_memory_info,
// _xla_transfer_to_host, _xlakit_build_info); init_python_bindings.cpp calls
// AddXlakitBindings from a one-line hook. Errors stay absl::Status until
// here, where they become Python exceptions.
#ifndef XLA_TORCH_XLA_CSRC_XLAKIT_XLAKIT_BINDINGS_H_
#define XLA_TORCH_XLA_CSRC_XLAKIT_XLAKIT_BINDINGS_H_

#include <pybind11/pybind11.h>

namespace torch_xla {
namespace xlakit {

void AddXlakitBindings(pybind11::module& m);

}  // namespace xlakit
}  // namespace torch_xla

#endif  // XLA_TORCH_XLA_CSRC_XLAKIT_XLAKIT_BINDINGS_H_
