// Allocator stats summed per device set; see memory_stats.h.
#include "torch_xla/csrc/runtime/xlakit/memory_stats.h"

namespace torch_xla {
namespace runtime {
namespace xlakit {

RuntimeMemoryInfo SumAllocatorStats(
    absl::Span<const tsl::AllocatorStats> stats) {
  RuntimeMemoryInfo total;
  total.bytes_limit = 0;
  total.peak_bytes_used = 0;
  for (const tsl::AllocatorStats& s : stats) {
    total.bytes_used += s.bytes_in_use;
    // One device that does not know makes the sum unknown.
    if (s.peak_bytes_in_use >= 0 && total.peak_bytes_used.has_value()) {
      *total.peak_bytes_used += s.peak_bytes_in_use;
    } else {
      total.peak_bytes_used.reset();
    }
    if (s.bytes_limit.has_value() && *s.bytes_limit >= 0 &&
        total.bytes_limit.has_value()) {
      *total.bytes_limit += *s.bytes_limit;
    } else {
      total.bytes_limit.reset();
    }
  }
  return total;
}

}  // namespace xlakit
}  // namespace runtime
}  // namespace torch_xla
