// The persistent cache's hooks in runtime/cache.h: entries are written
// atomically (temporary file + rename, see core/atomic_file.h) and outside
// the cache's lock, an empty serialization means "do not cache", an entry
// that cannot be read is a miss that keeps the file (an I/O error says nothing
// about the entry), and an entry the deserializer refused is erased only when
// its verdict says so (core/entry_fate.h), by a removal that never throws: a
// refused entry the job may not delete (a shared folder, a read-only one) is
// a counted miss, not a failed step. Nothing here throws or aborts: the cache
// costs a recompile, never a crash. Header-only so the header-only :cache
// library needs only the core.
#ifndef XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_CACHE_IO_H_
#define XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_CACHE_IO_H_

#include <exception>
#include <iostream>
#include <string>

#include <torch/csrc/lazy/core/metrics.h>

#include "torch_xla/csrc/runtime/xlakit/core/atomic_file.h"
#include "torch_xla/csrc/runtime/xlakit/core/entry_fate.h"

namespace torch_xla {
namespace runtime {
namespace xlakit {

// Call without the cache's lock: it fsyncs the entry and its folder.
inline void WriteCacheEntry(const std::string& path, const std::string& data) {
  if (data.empty()) return;
  std::string error;
  try {
    error = ::xlakit::WriteFileAtomic(path, data);
  } catch (const std::exception& e) {  // memory, mostly: the step goes on
    error = std::string("cannot write ") + path + ": " + e.what();
  }
  if (!error.empty()) {
    TORCH_LAZY_COUNTER("XlakitCacheWriteFailure", 1);
    std::cerr << "xlakit: cannot write cache entry: " << error << "\n";
  }
}

// The entry at `path` into `*data`; false when it cannot be read (counted as
// a miss, and as XlakitCacheReadFailure): the caller returns nothing and
// keeps the file.
inline bool ReadCacheEntry(const std::string& path, std::string* data) {
  std::string error = ::xlakit::ReadWholeFile(path, data);
  if (error.empty()) return true;
  TORCH_LAZY_COUNTER("PersistentCacheMiss", 1);
  TORCH_LAZY_COUNTER("XlakitCacheReadFailure", 1);
  std::cerr << "xlakit: cannot read cache entry (kept): " << error << "\n";
  return false;
}

// Removes an entry the deserializer refused for good; a failure is counted
// (XlakitCacheEraseFailure) and logged, never thrown.
inline void RemoveRefusedEntry(const std::string& path) {
  std::string error = ::xlakit::RemoveFile(path);
  if (error.empty()) return;
  TORCH_LAZY_COUNTER("XlakitCacheEraseFailure", 1);
  std::cerr << "xlakit: cannot remove a refused cache entry: " << error
            << "\n";
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
