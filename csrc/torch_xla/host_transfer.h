// Safe device-to-host transfer behind torch_xla._XLAC._xla_transfer_to_host:
// one sync of pending IR, copies in byte-capped batches, sharded data copied
// shard by shard (replica 0 only) and assembled on the host instead of
// replicated on the device, and one deadline bounding every wait. Placed at
// torch_xla/csrc/xlakit/ and compiled into init_python_bindings.
#ifndef XLA_TORCH_XLA_CSRC_XLAKIT_HOST_TRANSFER_H_
#define XLA_TORCH_XLA_CSRC_XLAKIT_HOST_TRANSFER_H_

#include <cstdint>
#include <vector>

#include <ATen/Tensor.h>

#include "absl/status/statusor.h"

namespace torch_xla {
namespace xlakit {

// Call without the GIL. DEADLINE_EXCEEDED names the stage, the tensor (by
// index, shape and dtype) and the bytes already on the host.
absl::StatusOr<std::vector<at::Tensor>> TransferToHost(
    const std::vector<at::Tensor>& tensors, int64_t max_inflight_bytes,
    double timeout_s);

}  // namespace xlakit
}  // namespace torch_xla

#endif  // XLA_TORCH_XLA_CSRC_XLAKIT_HOST_TRANSFER_H_
