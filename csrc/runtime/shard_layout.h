// Where each local shard of sharded device data goes in the full tensor, as
// a pure function of the data's OpSharding, the tensor's dimensions and the
// local shards (global device ordinal and the shard buffer's own dimensions).
// Every tile is taken from its lowest local replica, and a tile that no local
// device holds is an error naming it: on a multi-host pod a host sees only
// its own shards, and assembling from them alone would leave uninitialised
// memory in the result. Needs only xla_data.pb.h and absl, so `make
// cxx-check` tests it against real OpSharding protos.
#ifndef XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_SHARD_LAYOUT_H_
#define XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_SHARD_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "xla/xla_data.pb.h"

namespace torch_xla {
namespace runtime {
namespace xlakit {

struct LocalShard {
  int64_t device_ordinal = 0;  // global, as in the sharding's tile assignment
  std::vector<int64_t> dims;   // the shard buffer's own (padded) dimensions
};

// Copy elements [0, extent) of shard `shard` into [start, start + extent) of
// the full tensor. Regions never overlap; together they cover the tensor.
struct ShardRegion {
  size_t shard = 0;
  std::vector<int64_t> start;
  std::vector<int64_t> extent;
};

// REPLICATED and UNKNOWN (replicated, as torch_xla treats it) take one local
// shard whole. OTHER (tiled, optionally with trailing replicated tile
// dimensions: replicate_on_last_tile_dim or last_tile_dims all REPLICATED)
// takes each non-empty tile from its lowest local replica.
//   INVALID_ARGUMENT: the sharding does not fit the tensor or the shards
//     (tile rank, device count, shard dimensions, a device not in the
//     assignment);
//   FAILED_PRECONDITION: a tile is held by no local device;
//   UNIMPLEMENTED: other sharding types (MAXIMAL, TUPLE, MANUAL, ...).
absl::StatusOr<std::vector<ShardRegion>> PlanShardAssembly(
    const xla::OpSharding& sharding, absl::Span<const int64_t> tensor_dims,
    absl::Span<const LocalShard> shards);

// The sharding's device list in tile order (row-major over
// tile_assignment_dimensions), expanding the iota form.
absl::StatusOr<std::vector<int64_t>> TileAssignmentDevices(
    const xla::OpSharding& sharding);

}  // namespace xlakit
}  // namespace runtime
}  // namespace torch_xla

#endif  // XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_SHARD_LAYOUT_H_
