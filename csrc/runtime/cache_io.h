// The persistent cache's hooks in runtime/cache.h: entries are written
// atomically (temporary file + rename, see core/atomic_file.h), an empty
// serialization means "do not cache", and an entry the deserializer refused
// is erased only when its verdict says so (core/entry_fate.h): a load that
// failed for this process alone (device memory exhausted) keeps a good
// entry that other processes share. Header-only so the header-only :cache
// library needs only the core.
#ifndef XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_CACHE_IO_H_
#define XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_CACHE_IO_H_

#include <iostream>
#include <string>

#include <torch/csrc/lazy/core/metrics.h>

#include "torch_xla/csrc/runtime/xlakit/core/atomic_file.h"
#include "torch_xla/csrc/runtime/xlakit/core/entry_fate.h"

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

// Called right after the deserializer returned nothing, on the same thread.
inline bool ShouldEraseRefusedEntry() {
  if (::xlakit::TakeEntryFate() == ::xlakit::EntryFate::kErase) return true;
  TORCH_LAZY_COUNTER("XlakitCacheEntryKept", 1);
  return false;
}

}  // namespace xlakit
}  // namespace runtime
}  // namespace torch_xla

#endif  // XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_CACHE_IO_H_
