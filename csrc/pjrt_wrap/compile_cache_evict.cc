// The compile cache's bound (compile_cache.h, env.h kCacheMaxBytesEnv): after
// a write, the least recently used of the wrapper's own entries go until the
// rest fit, with the temporaries of writers killed long ago.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <ctime>
#include <string>
#include <vector>

#include "core/atomic_file.h"
#include "pjrt_wrap/compile_cache.h"
#include "pjrt_wrap/counters.h"

namespace xlakit {
namespace pjrt_wrap {

void CompileCache::Evict(const std::string& keep) {
  // Only the wrapper's own entries (64 hex digits) count and go; the folder
  // is listed at each write (a miss), never at a hit.
  DIR* dir = opendir(cfg_.dir.c_str());
  if (dir == nullptr) return;
  struct Entry {
    int64_t used_ns;
    std::string name;
    uint64_t bytes;
  };
  std::vector<Entry> entries;
  uint64_t total = 0;
  // A temporary of a writer killed long ago (core/atomic_file.h), kept as
  // long as `xlakit cache prune` keeps one (a live writer's is younger).
  constexpr time_t kAbandonedTempSeconds = 15 * 60;
  const time_t now = time(nullptr);
  while (struct dirent* d = readdir(dir)) {
    std::string name = d->d_name;
    struct stat tst;
    if (!TempFileTarget(name).empty() &&
        fstatat(dirfd(dir), d->d_name, &tst, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISREG(tst.st_mode) && tst.st_mtime + kAbandonedTempSeconds < now) {
      unlinkat(dirfd(dir), d->d_name, 0);
      continue;
    }
    if (name.size() != 64 ||
        name.find_first_not_of("0123456789abcdef") != std::string::npos) {
      continue;
    }
    struct stat st;
    if (fstatat(dirfd(dir), d->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
        !S_ISREG(st.st_mode)) {
      continue;
    }
    total += static_cast<uint64_t>(st.st_size);
    entries.push_back({int64_t{st.st_mtim.tv_sec} * 1000000000 +
                           st.st_mtim.tv_nsec,
                       name, static_cast<uint64_t>(st.st_size)});
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) {
              return a.used_ns != b.used_ns ? a.used_ns < b.used_ns
                                            : a.name < b.name;
            });
  for (const Entry& e : entries) {
    if (total <= cfg_.max_bytes) break;
    if (e.name == keep) continue;
    if (unlinkat(dirfd(dir), e.name.c_str(), 0) == 0) {
      unlinkat(dirfd(dir), (e.name + kPartsSuffix).c_str(), 0);
      total -= e.bytes;
      ++GlobalCounters().evictions;
    }
  }
  closedir(dir);
}

}  // namespace pjrt_wrap
}  // namespace xlakit
