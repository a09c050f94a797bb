// Safe device-to-host transfer behind torch_xla._XLAC._xla_transfer_to_host:
// copies in byte-capped batches, sharded data copied tile by tile (each from
// its lowest local replica, runtime/xlakit/shard_layout.h) and assembled on
// the host instead of replicated on the device, and one deadline bounding
// every wait. It never compiles: tensors with pending computations are
// refused (FAILED_PRECONDITION), since no deadline can bound a compile; the
// caller syncs first, as xlakit.save does in its "sync" stage. Sharded data whose tiles are
// not all on this host (multi-host) is refused, not half-assembled. Placed at
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
// index, shape and dtype) and the bytes already on the host;
// FAILED_PRECONDITION names tensors with pending computations, or tiles held
// by no local device.
absl::StatusOr<std::vector<at::Tensor>> TransferToHost(
    const std::vector<at::Tensor>& tensors, int64_t max_inflight_bytes,
    double timeout_s);

}  // namespace xlakit
}  // namespace torch_xla

#endif  // XLA_TORCH_XLA_CSRC_XLAKIT_HOST_TRANSFER_H_
