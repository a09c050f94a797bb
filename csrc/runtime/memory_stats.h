// Runtime memory info for one device or the sum over several (the SPMD
// virtual device), from tsl::AllocatorStats. A field a platform does not
// report is unknown (nullopt), never summed as a number: the PJRT C API
// client reports peak_bytes_in_use as -1 when the plugin leaves it unset,
// and bytes_limit is an optional. Needs only tsl headers.
#ifndef XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_MEMORY_STATS_H_
#define XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_MEMORY_STATS_H_

#include <cstdint>
#include <optional>

#include "absl/types/span.h"
#include "xla/tsl/framework/allocator.h"

namespace torch_xla {
namespace runtime {
namespace xlakit {

struct RuntimeMemoryInfo {
  int64_t bytes_used = 0;
  // Unknown when any summed device does not report it.
  std::optional<int64_t> bytes_limit;
  // For several devices the sum of per-device peaks: an upper bound, since
  // devices peak at different times.
  std::optional<int64_t> peak_bytes_used;
};

// The sum over `stats` (one entry per device); empty input gives zeros.
RuntimeMemoryInfo SumAllocatorStats(
    absl::Span<const tsl::AllocatorStats> stats);

}  // namespace xlakit
}  // namespace runtime
}  // namespace torch_xla

#endif  // XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_MEMORY_STATS_H_
