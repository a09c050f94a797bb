// The compile cache's store (compile_cache.h): an entry read, judged (who may
// write it, its envelope, tag and stored key) and loaded into the plugin at a
// hit; an executable serialized into an entry, with its key record, after a
// miss.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "core/atomic_file.h"
#include "core/envelope.h"
#include "pjrt_wrap/compile_cache.h"
#include "pjrt_wrap/counters.h"
#include "pjrt_wrap/pjrt_calls.h"

namespace xlakit {
namespace pjrt_wrap {
namespace {

// How much of an entry one read() asks for: the payload is read straight into
// its buffer, so this only sets the number of calls.
constexpr size_t kReadChunkBytes = size_t{4} << 20;

}  // namespace

bool CompileCache::TryLoad(const ClientInfo& info, const std::string& key,
                           const std::string& path,
                           PJRT_Client_Compile_Args* args) {
  Counters& counters = GlobalCounters();
  // O_NONBLOCK: a FIFO under an entry's name must not block the compile;
  // O_NOFOLLOW: a link is never followed.
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT) return false;
    counters.Refused("unreadable");
    LogOnce("unreadable", "cannot read cache entry " + path + ": " +
                              (errno == ELOOP
                                   ? std::string("it is a symbolic link, and "
                                                 "entries are never read "
                                                 "through links")
                                   : std::string(std::strerror(errno))) +
                              "; compiling instead");
    return false;
  }
  std::string error;
  EntryPayload payload;
  DecodeResult verdict;
  struct stat st;
  EntryTrust trust;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    error = "not a regular file";
  } else if (!(trust = JudgeCacheEntry(path, st, cfg_.trust_shared)).trusted) {
    // Who can rewrite this file, judged on the descriptor it would be read
    // from: the folder's judgement at the start covered the folders only.
    close(fd);
    counters.Refused("untrusted_entry");
    LogOnce("untrusted_entry", "cache entry refused (untrusted_entry): " +
                                   trust.problem + "; compiling instead (fix: " +
                                   trust.fix + ")");
    return false;
  } else {
    // Streamed (core/envelope.h ReadEntry): the header first, so garbage of
    // any size is refused after one small read and an entry over the cap
    // unread; then the payload, once, into the buffer the plugin is given,
    // through the checksum and the tag; the stored key last.
    std::unique_ptr<EntryMac> mac = NewMac();
    EntryCheck check;
    check.self = &info.self;
    check.mac = mac.get();
    check.expected_key = &key;
    check.max_entry_bytes = cfg_.max_entry_bytes;
    verdict = ReadEntry(fd, static_cast<uint64_t>(st.st_size), check,
                        kReadChunkBytes, &payload, &error);
  }
  close(fd);
  if (!error.empty()) {
    counters.Refused("unreadable");
    LogOnce("unreadable", "cannot read cache entry " + path + ": " + error +
                              "; compiling instead");
    return false;
  }
  if (verdict.status != EntryStatus::kOk) {
    const char* reason = EntryStatusName(verdict.status);
    counters.Refused(reason);
    LogOnce(reason, std::string("cache entry refused (") + reason +
                        "): " + verdict.message + "; compiling instead (" +
                        path + ")");
    return false;
  }
  const auto start = std::chrono::steady_clock::now();
  PJRT_LoadedExecutable* loaded = nullptr;
  if (!DeserializeAndLoad(real_, args->client, payload.view(), &loaded,
                          &error)) {
    counters.Refused("load_failed");
    LogOnce("load_failed", "the plugin could not load cache entry " + path +
                               ": " + error + "; compiling instead");
    return false;
  }
  counters.load_us += MicrosSince(start);
  // A hit is a use: its times say when, for least-recently-used eviction
  // (`xlakit cache prune --max-bytes`). A worker that may not write the entry
  // leaves it as it is.
  utimensat(AT_FDCWD, path.c_str(), nullptr, AT_SYMLINK_NOFOLLOW);
  args->executable = loaded;
  return true;
}

void CompileCache::Store(const ClientInfo& info, const std::string& key,
                         const std::string& path,
                         PJRT_LoadedExecutable* executable,
                         const KeyRecord& record) {
  Counters& counters = GlobalCounters();
  std::string serialized;
  std::string error;
  if (!SerializeExecutable(real_, executable, &serialized, &error) ||
      serialized.empty()) {
    ++counters.serialize_failures;
    LogOnce("serialize", "cannot cache executables: the plugin did not "
                         "serialize one (" +
                             (error.empty() ? "empty" : error) +
                             "); they compile on every restart");
    return;
  }
  EntryHeader header;
  header.kind = EntryKind::kExecutable;
  header.platform_name = info.self.platform_name;
  header.platform_version = info.self.platform_version;
  header.patch_series_id = info.self.patch_series_id;
  header.cache_key = key;
  if (serialized.size() + kAuthPrefixBytes + kMaxHeaderBytes >
      cfg_.max_entry_bytes) {
    ++counters.write_failures;
    LogOnce("too_large",
            "not caching an executable of " +
                std::to_string(serialized.size()) + " bytes: an entry may "
                "have " + std::to_string(cfg_.max_entry_bytes) + " (" +
                kCacheMaxEntryBytesEnv + "); it compiles on every restart");
    return;
  }
  std::unique_ptr<EntryMac> mac = NewMac();
  std::string entry = mac ? EncodeAuthenticatedEntry(header, serialized, *mac)
                          : EncodeEntry(header, serialized);
  error = entry.empty() ? "the HMAC failed" : WriteFileAtomic(path, entry);
  if (!error.empty()) {
    ++counters.write_failures;
    LogOnce("write", "cannot write cache entry: " + error +
                         "; the job goes on, compiling on every restart");
    return;
  }
  ++counters.writes;
  // Its key's parts, after it (a record never names a missing entry for
  // long); a failure costs explanations, never the entry.
  if (!record.parts.empty()) {
    WriteFileAtomic(path + kPartsSuffix, KeyRecordJson(record, key));
  }
  if (cfg_.max_bytes > 0) Evict(key);
}

}  // namespace pjrt_wrap
}  // namespace xlakit
