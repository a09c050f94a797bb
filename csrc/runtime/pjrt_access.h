// xlakit's adapters inside torch_xla's PJRT client: the persistent-cache
// codec, the cache-key salt, runtime memory info by raw device string, and
// shard access for host transfers. PjRtComputationClient names PjRtAccess a
// friend (a one-line hook), so the logic lives here instead of in upstream
// files; what needs no torch_xla (cache_entry.h, memory_stats.h) is thinner
// still and tested against a real PJRT client. Placed into the torch_xla
// tree at torch_xla/csrc/runtime/xlakit/ by build/xlakit_build.py.
#ifndef XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_PJRT_ACCESS_H_
#define XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_PJRT_ACCESS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "xla/pjrt/pjrt_client.h"

#include "torch_xla/csrc/runtime/computation_client.h"
#include "torch_xla/csrc/runtime/xlakit/memory_stats.h"

namespace torch_xla {
namespace runtime {

class PjRtComputationClient;

namespace xlakit {

// One addressable piece of a tensor's device data: the whole buffer for
// unsharded data, one shard (of replica 0) for sharded data.
struct DevicePiece {
  std::shared_ptr<xla::PjRtBuffer> buffer;
  std::string device;  // runtime device string, e.g. "TPU:3"
};

struct DataPieces {
  bool is_sharded = false;
  xla::OpSharding sharding;
  std::vector<DevicePiece> pieces;
};

class PjRtAccess {
 public:
  // The serialized executable in xlakit's envelope, tagged when the job has
  // a key (XLAKIT_CACHE_KEY); "" (nothing is cached) where the client cannot
  // serialize it or the tag cannot be computed.
  static std::string SerializeComputation(
      PjRtComputationClient& client,
      const ComputationClient::ComputationPtr& computation);

  // nullptr (a counted miss, then a recompile) for any entry that is foreign,
  // corrupt, truncated, for another runtime, without a tag that verifies
  // under the job's key (checked before the client sees it), or that the
  // client refuses; notes the entry's fate (core/entry_fate.h) for the cache
  // that called. Never compiles: it runs under the persistent cache's lock.
  static ComputationClient::ComputationPtr DeserializeComputation(
      PjRtComputationClient& client, const std::string& serialized);

  // Folds platform name, platform version, the patch-series id (which
  // covers the series, the placed csrc/ and the upstream commits) and the id
  // of the job's key (XLAKIT_CACHE_KEY; none without one) into the
  // compilation-environment hash that is part of every cache key.
  static torch::lazy::hash_t SaltCompilationEnvHash(xla::PjRtClient* client,
                                                    torch::lazy::hash_t hash);

  // INVALID_ARGUMENT listing valid devices for an unknown device;
  // UNIMPLEMENTED when the platform keeps no allocator stats. "SPMD:0" sums
  // the local devices (SumAllocatorStats).
  static absl::StatusOr<RuntimeMemoryInfo> GetRuntimeMemoryInfo(
      PjRtComputationClient& client, const std::string& device);

  // The device buffers behind `handle` without copying or replicating them.
  // FAILED_PRECONDITION while the data is still a placeholder.
  static absl::StatusOr<DataPieces> GetDataPieces(
      PjRtComputationClient& client, const ComputationClient::DataPtr& handle);
};

}  // namespace xlakit
}  // namespace runtime
}  // namespace torch_xla

#endif  // XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_PJRT_ACCESS_H_
