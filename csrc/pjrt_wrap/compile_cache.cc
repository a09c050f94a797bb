// The compile cache; see compile_cache.h.
#include "pjrt_wrap/compile_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/atomic_file.h"
#include "core/envelope.h"
#include "pjrt_wrap/counters.h"
#include "pjrt_wrap/env.h"
#include "pjrt_wrap/key_parts.h"
#include "pjrt_wrap/pjrt_calls.h"
#include "pjrt_wrap/proto_canon.h"

namespace xlakit {
namespace pjrt_wrap {
namespace {

using Clock = std::chrono::steady_clock;

uint64_t MicrosSince(Clock::time_point start) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() -
                                                            start)
          .count());
}

// The functions the cache calls besides Compile; a plugin without one of
// them gets no cache (its compiles pass straight through).
const char* MissingFunction(const PJRT_Api* api) {
#define XLAKIT_REQUIRE(field) \
  if (!XLAKIT_PJRT_HAS(api, field)) return #field;
  XLAKIT_REQUIRE(PJRT_Client_PlatformName)
  XLAKIT_REQUIRE(PJRT_Client_PlatformVersion)
  XLAKIT_REQUIRE(PJRT_Client_Devices)
  XLAKIT_REQUIRE(PJRT_Device_GetDescription)
  XLAKIT_REQUIRE(PJRT_DeviceDescription_ProcessIndex)
  XLAKIT_REQUIRE(PJRT_DeviceDescription_Kind)
  XLAKIT_REQUIRE(PJRT_LoadedExecutable_GetExecutable)
  XLAKIT_REQUIRE(PJRT_Executable_Serialize)
  XLAKIT_REQUIRE(PJRT_Executable_Destroy)
  XLAKIT_REQUIRE(PJRT_Executable_DeserializeAndLoad)
#undef XLAKIT_REQUIRE
  return nullptr;
}

// Creates `dir` and the folders above it that are missing, each with exactly
// `mode`, whatever the umask; "" on success.
std::string MakeFolders(const std::string& dir, mode_t mode) {
  std::vector<std::string> missing;
  for (std::string path = dir; !path.empty() && path != "/";) {
    struct stat st;
    if (stat(path.c_str(), &st) == 0) break;
    missing.push_back(path);
    size_t slash = path.rfind('/');
    path = slash == std::string::npos ? "" : path.substr(0, slash);
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (mkdir(it->c_str(), mode) != 0) {
      if (errno == EEXIST) continue;  // another process made it; judged again
      return "cannot create " + *it + ": " + std::strerror(errno);
    }
    chmod(it->c_str(), mode);
  }
  return "";
}

// How much of an entry one read() asks for: the payload is read straight into
// its buffer, so this only sets the number of calls.
constexpr size_t kReadChunkBytes = size_t{4} << 20;

// SHA-256 of a file, streamed; "" with `*error` set if it cannot be read.
std::string FileDigest(const Libcrypto& crypto, const std::string& path,
                       std::string* error) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *error = "cannot read " + path + ": " + std::strerror(errno);
    return "";
  }
  Sha256 sha(crypto);
  char buf[1 << 20];
  while (true) {
    ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n < 0) *error = "cannot read " + path + ": " + std::strerror(errno);
      break;
    }
    sha.Update(std::string_view(buf, static_cast<size_t>(n)));
  }
  close(fd);
  return error->empty() ? sha.Hex() : "";
}

// The real plugin's SHA-256, remembered per host and user in
// ~/.cache/xlakit/pjrt-digests, one small file per plugin path holding the
// file's device, inode, size, mtime and ctime (which no user can set back)
// and its digest: libtpu is hundreds of MB, and every rank of every start
// hashed it. A memo that is not the user's own, or that others can write, is
// ignored; any change to the file hashes it again.
std::string PluginDigest(const Libcrypto& crypto, const std::string& path,
                         std::string* error) {
  struct stat st;
  const char* home = std::getenv("HOME");
  if (stat(path.c_str(), &st) != 0 || home == nullptr || *home == '\0') {
    return FileDigest(crypto, path, error);
  }
  const std::string stamp =
      std::to_string(st.st_dev) + " " + std::to_string(st.st_ino) + " " +
      std::to_string(st.st_size) + " " + std::to_string(st.st_mtim.tv_sec) +
      "." + std::to_string(st.st_mtim.tv_nsec) + " " +
      std::to_string(st.st_ctim.tv_sec) + "." +
      std::to_string(st.st_ctim.tv_nsec) + " ";
  const std::string folder = std::string(home) + "/.cache/xlakit/pjrt-digests";
  Sha256 name(crypto);
  name.Update(path);
  const std::string memo = folder + "/" + name.Hex().substr(0, 32);
  int fd = open(memo.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd >= 0) {
    struct stat ms;
    char buf[512];
    ssize_t n = -1;
    if (fstat(fd, &ms) == 0 && S_ISREG(ms.st_mode) &&
        ms.st_uid == geteuid() && (ms.st_mode & 022) == 0) {
      n = read(fd, buf, sizeof(buf));
    }
    close(fd);
    const std::string line = n > 0 ? std::string(buf, n) : "";
    if (line.size() == stamp.size() + 65 && line.rfind(stamp, 0) == 0 &&
        line.back() == '\n') {
      return line.substr(stamp.size(), 64);
    }
  }
  std::string digest = FileDigest(crypto, path, error);
  if (!digest.empty() && MakeFolders(folder, 0700).empty()) {
    WriteFileAtomic(memo, stamp + digest + "\n");  // a failure costs a hash
  }
  return digest;
}

}  // namespace

std::unique_ptr<CompileCache> CompileCache::Open(const PJRT_Api* real,
                                                 const CacheConfig& cfg,
                                                 CacheState* state) {
  state->dir = cfg.dir;
  state->read_only = cfg.read_only;
  if (cfg.dir.empty()) {
    state->why_off = std::string("no cache folder (") + kCacheDirEnv +
                     " unset or empty): every call passes straight through";
    return nullptr;
  }
  if (!cfg.env_problem.empty()) {
    state->why_off = cfg.env_problem;
    return nullptr;
  }
  // The one rule for the key's length (core/envelope.h), which Python applies too.
  if (std::string problem = CacheKeyProblem(cfg.key); !problem.empty()) {
    state->why_off = problem +
                     "; the cache stays off rather than run unauthenticated "
                     "entries";
    return nullptr;
  }
  if (const char* missing = MissingFunction(real)) {
    state->why_off = std::string("the plugin does not implement ") + missing +
                     ", which the cache needs";
    return nullptr;
  }
  std::string why;
  const Libcrypto* crypto = LoadLibcrypto(&why);
  if (crypto == nullptr) {
    state->why_off = "no SHA-256 for cache keys: " + why;
    return nullptr;
  }
  // The folder and those above it; each entry is judged as it is read
  // (TryLoad): a start costs no stat per entry.
  FolderTrust trust = JudgeCacheFolder(cfg.dir, cfg.trust_shared,
                                       /*judge_entries=*/false);
  struct stat before;
  if (trust.trusted() && !cfg.read_only &&
      stat(trust.folder.c_str(), &before) != 0) {
    std::string error =
        MakeFolders(trust.folder, cfg.trust_shared ? 0750 : 0700);
    if (!error.empty()) {
      state->why_off = error + " (pass a folder you can write, or set " +
                       kCacheReadOnlyEnv + "=1)";
      return nullptr;
    }
    // What got made.
    trust = JudgeCacheFolder(cfg.dir, cfg.trust_shared,
                             /*judge_entries=*/false);
  }
  state->folder = trust.state;
  state->dir = trust.folder;
  struct stat st;
  if (stat(trust.folder.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) {
    state->why_off = trust.folder + " is not a folder: set " + kCacheDirEnv +
                     " to a folder (it is created if missing)";
    return nullptr;
  }
  if (!trust.trusted()) {
    state->why_off =
        "expected a cache folder only you (and root) can write, since its "
        "entries are code your jobs run; found " +
        trust.problem + "; fix: " + trust.fix;
    return nullptr;
  }
  for (const std::string& s : trust.shared) {
    Log("cache folder " + trust.folder + " is shared (" + kTrustSharedEnv +
        "): " + s + "; every one of them can put code into this job");
  }
  std::string digest = PluginDigest(*crypto, cfg.plugin_path, &why);
  if (digest.empty()) {
    state->why_off = "cannot key entries by the plugin's build: " + why;
    return nullptr;
  }
  CacheConfig resolved = cfg;
  resolved.dir = trust.folder;
  std::unique_ptr<CompileCache> cache(
      new CompileCache(real, std::move(resolved), *crypto));
  cache->plugin_build_ =
      digest + " " + std::to_string(real->pjrt_api_version.major_version) +
      "." + std::to_string(real->pjrt_api_version.minor_version);
  std::string flag_problem;
  cache->flags_ = KeyedEnvironment(*crypto, &flag_problem);
  cache->flag_parts_ = KeyedFlags(*crypto, &flag_problem);
  if (!flag_problem.empty()) {
    state->why_off = flag_problem +
                     "; the cache stays off rather than key compiles without "
                     "those flags (point the variable at a regular file of "
                     "flags)";
    return nullptr;
  }
  cache->codegen_env_ = KeyedCodegenEnvironment();
  state->on = true;
  state->authenticated = !cfg.key.empty();
  return cache;
}

CompileCache::CompileCache(const PJRT_Api* real, CacheConfig cfg,
                           const Libcrypto& crypto)
    : real_(real), cfg_(std::move(cfg)), crypto_(crypto) {
  if (!cfg_.key.empty()) {
    // The same id Python gives a key (compile_cache.key_id): it names the
    // key without revealing it.
    key_id_ = HmacHex(crypto_, cfg_.key, "xlakit-cache-key-id").substr(0, 16);
  }
}

std::unique_ptr<EntryMac> CompileCache::NewMac() const {
  if (cfg_.key.empty()) return nullptr;
  return NewLibcryptoMac(crypto_, cfg_.key);
}

CompileCache::ClientInfo CompileCache::Info(PJRT_Client* client) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = clients_.find(client);
  if (found != clients_.end()) return found->second;
  ClientInfo info;
  std::string error;
  info.ok = PlatformName(real_, client, &info.self.platform_name, &error) &&
            PlatformVersion(real_, client, &info.self.platform_version,
                            &error) &&
            DescribeTopology(real_, client, &info.topology,
                             &info.topology_source, &error);
  info.error = error;
  if (info.ok) {
    LogOnce("topology", "cache keys cover the " +
                            std::string(info.topology_source == "devices"
                                            ? "device kinds and counts (the "
                                              "plugin has no topology "
                                              "description)"
                                            : "plugin's topology description "
                                              "and device kinds") +
                            ", not the host: the hosts of a pod share entries");
  }
  info.self.patch_series_id = std::string("pjrt-wrap/") + kWrapperVersion;
  clients_[client] = info;
  return info;
}

void CompileCache::ForgetClient(PJRT_Client* client) {
  std::lock_guard<std::mutex> lock(mu_);
  clients_.erase(client);
}

std::string CompileCache::KeyFor(const ClientInfo& info,
                                 const PJRT_Client_Compile_Args& args) {
  const PJRT_Program* program = args.program;
  if (program == nullptr || program->code == nullptr) return "";
  Sha256 sha(crypto_);
  // Each field length-prefixed, so no two different inputs hash the same
  // bytes.
  auto field = [&sha](const char* data, size_t size) {
    unsigned char n[8];
    for (int i = 0; i < 8; ++i) n[i] = static_cast<unsigned char>(size >> (8 * i));
    sha.Update(std::string_view(reinterpret_cast<const char*>(n), 8));
    sha.Update(std::string_view(data ? data : "", data ? size : 0));
  };
  auto text = [&field](const std::string& s) { field(s.data(), s.size()); };
  text("xlakit-pjrt-wrap-key");
  text(kWrapperVersion);
  text(plugin_build_);
  text(info.self.platform_name);
  text(info.self.platform_version);
  text(flags_);
  text(info.topology);
  text(key_id_);
  std::string_view format(program->format ? program->format : "",
                          program->format ? program->format_size : 0);
  text(std::string(format));
  text(CanonicalProgram(format,
                        std::string_view(program->code, program->code_size)));
  text(CanonicalCompileOptions(std::string_view(
      args.compile_options ? args.compile_options : "",
      args.compile_options ? args.compile_options_size : 0)));
  return sha.Hex();
}

KeyRecord CompileCache::RecordFor(const ClientInfo& info,
                                  const PJRT_Client_Compile_Args& args) {
  KeyRecordInputs in;
  in.plugin_build = plugin_build_;
  in.flags = &flag_parts_;
  in.codegen_env = codegen_env_;
  in.platform_name = info.self.platform_name;
  in.platform_version = info.self.platform_version;
  in.topology = info.topology;
  in.topology_source = info.topology_source;
  in.key_id = key_id_;
  return MakeKeyRecord(crypto_, in, args);
}

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
  Clock::time_point start = Clock::now();
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

void CompileCache::EndFlight(const std::string& key,
                             const std::shared_ptr<Flight>& flight) noexcept {
  std::lock_guard<std::mutex> lock(flight_mu_);
  flight->done = true;
  in_flight_.erase(key);
  pthread_cond_broadcast(&flight->cv);
}

bool CompileCache::Lookup(PJRT_Client_Compile_Args* args, CompileLookup* out) {
  Counters& counters = GlobalCounters();
  out->info = Info(args->client);
  if (out->info.ok) {
    out->key = KeyFor(out->info, *args);
    if (!out->key.empty()) out->path = cfg_.dir + "/" + out->key;
  }
  if (out->path.empty()) {
    LogOnce("key", "cannot key a program for the cache (" +
                       (out->info.error.empty() ? std::string("no program bytes")
                                                : out->info.error) +
                       "); compiling without it");
    return false;
  }
  // Single flight: wait while another thread has this key in hand, then take
  // it; Compile ends the flight (and the next waiter looks up) however it
  // returns.
  {
    auto mine = std::make_shared<Flight>();
    std::unique_lock<std::mutex> lock(flight_mu_);
    for (auto it = in_flight_.find(out->key); it != in_flight_.end();
         it = in_flight_.find(out->key)) {
      std::shared_ptr<Flight> other = it->second;
      ++counters.flight_waits;
      while (!other->done) {
        pthread_cond_wait(&other->cv, lock.mutex()->native_handle());
      }
    }
    in_flight_[out->key] = mine;
    out->flight = std::move(mine);
  }
  try {
    if (TryLoad(out->info, out->key, out->path, args)) return true;
  } catch (...) {
    counters.Refused("exception");
  }
  if (cfg_.explain || !cfg_.read_only) {
    out->record = RecordFor(out->info, *args);
    if (cfg_.explain) Log(ExplainMiss(out->record, cfg_.dir, out->key));
  }
  return false;
}

PJRT_Error* CompileCache::Compile(PJRT_Client_Compile_Args* args) {
  Counters& counters = GlobalCounters();
  // Everything before the real compile may fail (no memory, a plugin call
  // that throws nothing but allocates): the compile then goes on as a miss,
  // or without the cache where no key was made. Nothing after it may lose
  // the real compile's result.
  CompileLookup lookup;
  bool hit = false;
  try {
    hit = Lookup(args, &lookup);
  } catch (...) {
    ++counters.internal_errors;  // a key made stays: the compile is a miss
    hit = false;
  }
  struct Land {  // the flight ends however this returns
    CompileCache* cache;
    const CompileLookup& lookup;
    ~Land() {
      if (lookup.flight) cache->EndFlight(lookup.key, lookup.flight);
    }
  } land{this, lookup};
  if (hit) {
    ++counters.hits;
    return nullptr;
  }
  if (lookup.path.empty()) {
    ++counters.bypassed;
    return real_->PJRT_Client_Compile(args);
  }
  ++counters.misses;
  Clock::time_point start = Clock::now();
  PJRT_Error* error = real_->PJRT_Client_Compile(args);
  const uint64_t compile_us = MicrosSince(start);
  counters.compile_us += compile_us;
  if (error == nullptr && args->executable != nullptr && !cfg_.read_only &&
      compile_us < cfg_.min_compile_us) {
    ++counters.skipped_fast;
  } else if (error == nullptr && args->executable != nullptr &&
             !cfg_.read_only) {
    try {
      Store(lookup.info, lookup.key, lookup.path, args->executable,
            lookup.record);
    } catch (...) {
      ++counters.write_failures;
    }
  }
  return error;
}

}  // namespace pjrt_wrap
}  // namespace xlakit
