// Opening the compile cache (compile_cache.h CompileCache::Open): the plugin
// functions it needs, the folder made and judged, libcrypto, the key's
// length, the real plugin's digest (remembered per host), and the
// environment every key covers.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/atomic_file.h"
#include "core/envelope.h"
#include "pjrt_wrap/compile_cache.h"
#include "pjrt_wrap/counters.h"
#include "pjrt_wrap/env.h"
#include "pjrt_wrap/key_parts.h"
#include "pjrt_wrap/pjrt_calls.h"

namespace xlakit {
namespace pjrt_wrap {
namespace {

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

}  // namespace pjrt_wrap
}  // namespace xlakit
