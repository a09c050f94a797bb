// The persistent cache's file write, used by the hook in runtime/cache.h:
// entries are written atomically (temporary file + rename, see
// core/atomic_file.h) and an empty serialization means "do not cache".
// Header-only so the header-only :cache library needs only the core.
#ifndef XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_CACHE_IO_H_
#define XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_CACHE_IO_H_

#include <iostream>
#include <string>

#include <torch/csrc/lazy/core/metrics.h>

#include "torch_xla/csrc/runtime/xlakit/core/atomic_file.h"

namespace torch_xla {
namespace runtime {
namespace xlakit {

inline void WriteCacheEntry(const std::string& path, const std::string& data) {
  if (data.empty()) return;
  std::string error = ::xlakit::WriteFileAtomic(path, data);
  if (!error.empty()) {
    // A cache that cannot be written costs a recompile later, not a crash.
    TORCH_LAZY_COUNTER("XlakitCacheWriteFailure", 1);
    std::cerr << "xlakit: cannot write cache entry: " << error << "\n";
  }
}

}  // namespace xlakit
}  // namespace runtime
}  // namespace torch_xla

#endif  // XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_CACHE_IO_H_
