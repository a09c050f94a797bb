// libxlakit_pjrt_wrap.so: a PJRT C API plugin that wraps the real one.
//
// The framework (torch_xla, jax) loads this library where it would load the
// real plugin and calls GetPjrtApi. The first call loads the real plugin
// (XLAKIT_PJRT_PLUGIN; default the libtpu installed beside xlakit), checks
// that its C API major version is this header's, copies its whole PJRT_Api
// (its own struct_size and version numbers, so the framework negotiates with
// the real plugin exactly as without the wrapper), and replaces three
// functions:
//   PJRT_Client_Compile   served from the compile cache (compile_cache.h);
//   PJRT_Client_Destroy   forgets what the cache learned about the client;
//   PJRT_LoadedExecutable_Execute  pads an older framework's
//                         PJRT_ExecuteOptions to this header's size
//                         (execute_bridge.h).
// Memory accounting (memory_accounting.h) then wraps the functions that make
// and free buffers, clients and executables, and PJRT_Device_MemoryStats.
// Everything else is the real plugin's own function. A plugin that cannot be
// wrapped gets a table that refuses to start with the reason (refusal.h).
#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "pjrt_wrap/compile_cache.h"
#include "pjrt_wrap/counters.h"
#include "pjrt_wrap/env.h"
#include "pjrt_wrap/execute_bridge.h"
#include "pjrt_wrap/memory_accounting.h"
#include "pjrt_wrap/proto_canon.h"
#include "pjrt_wrap/refusal.h"
#include "xla/pjrt/c/pjrt_c_api.h"

#define XLAKIT_EXPORT extern "C" __attribute__((visibility("default")))

XLAKIT_EXPORT const PJRT_Api* GetPjrtApi();

namespace xlakit {
namespace pjrt_wrap {
namespace {

struct Wrapper {
  std::string self_path;
  std::string plugin_path;
  std::string plugin_from;
  const PJRT_Api* real = nullptr;
  std::string refused;
  CacheState cache_state;
  std::unique_ptr<CompileCache> cache;
  std::unique_ptr<char[]> table;
};

Wrapper* wrapper = nullptr;  // set once, by Activate, before any use

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

// A flag as xlakit's Python reads it (1, true, yes, on, y or 0, false, no,
// off, n; any case, spaces around; unset or empty is false). Anything else
// is false and adds to *problem what is wrong, naming the variable.
bool Flag(const char* name, std::string* problem) {
  const std::string raw = Env(name);
  std::string v = raw;
  v.erase(0, v.find_first_not_of(" \t"));
  v.erase(v.find_last_not_of(" \t") + 1);
  for (char& c : v) c = static_cast<char>(std::toupper(c));
  if (v == "1" || v == "TRUE" || v == "YES" || v == "ON" || v == "Y") return true;
  if (!(v.empty() || v == "0" || v == "FALSE" || v == "NO" || v == "OFF" ||
        v == "N")) {
    *problem += std::string(problem->empty() ? "" : "; ") +
                "environment variable " + name + "=" + "'" + raw + "'" +
                ": expected 1 or 0 (true/false, yes/no, on/off)";
  }
  return false;
}

// The cache folder, read as xlakit's Python reads a cache path
// (cache_trust.local_folder): a leading `~` is $HOME; a URL (`scheme://...`)
// is never taken for a folder, since no shared tier on object storage exists
// yet: it adds to *problem what is wrong, and the cache stays off.
std::string CacheDir(std::string* problem) {
  std::string dir = Env(kCacheDirEnv);
  const size_t sep = dir.find("://");
  bool url = sep != std::string::npos && sep > 0 &&
             std::isalpha(static_cast<unsigned char>(dir[0]));
  for (size_t i = 0; url && i < sep; ++i) {
    const unsigned char c = static_cast<unsigned char>(dir[i]);
    url = std::isalnum(c) || c == '+' || c == '.' || c == '-';
  }
  if (url) {
    *problem += std::string(problem->empty() ? "" : "; ") + kCacheDirEnv +
                "='" + dir +
                "' is a URL: a shared compile cache tier on object storage is "
                "not available yet, and a URL is never taken for a local "
                "folder; set it to a local folder";
    return dir;
  }
  const char* home = std::getenv("HOME");
  if ((dir == "~" || dir.rfind("~/", 0) == 0) && home && *home) {
    dir = home + dir.substr(1);
  }
  return dir;
}

// A byte count: a positive decimal integer, else `fallback`, adding to
// *problem what is wrong, naming the variable. Unset or empty is `fallback`.
uint64_t Bytes(const char* name, uint64_t fallback, std::string* problem) {
  const std::string raw = Env(name);
  if (raw.empty()) return fallback;
  uint64_t value = 0;
  bool ok = raw.size() <= 19;
  for (char c : raw) {
    if (c < '0' || c > '9') ok = false;
    if (ok) value = value * 10 + static_cast<uint64_t>(c - '0');
  }
  if (ok && value > 0) return value;
  *problem += std::string(problem->empty() ? "" : "; ") +
              "environment variable " + name + "='" + raw +
              "': expected a positive number of bytes, e.g. " +
              std::to_string(fallback);
  return fallback;
}

// A duration in seconds (0 or more, decimals allowed) as microseconds; unset
// or empty is 0. Anything else is 0 and adds to *problem what is wrong.
uint64_t Micros(const char* name, std::string* problem) {
  const std::string raw = Env(name);
  if (raw.empty()) return 0;
  char* end = nullptr;
  const double seconds = std::strtod(raw.c_str(), &end);
  if (end != nullptr && *end == '\0' && seconds >= 0 && seconds < 1e6) {
    return static_cast<uint64_t>(seconds * 1e6);
  }
  *problem += std::string(problem->empty() ? "" : "; ") +
              "environment variable " + name + "='" + raw +
              "': expected a number of seconds, e.g. 1.5";
  return 0;
}

std::string DirName(const std::string& path) {
  size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

bool SameFile(const std::string& a, const std::string& b) {
  struct stat sa, sb;
  return stat(a.c_str(), &sa) == 0 && stat(b.c_str(), &sb) == 0 &&
         sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

std::string ApiVersion(int major, int minor) {
  return std::to_string(major) + "." + std::to_string(minor);
}

// The functions below are what the framework calls: none lets an exception
// out through the C ABI (that would abort the process). CompileCache::Compile
// catches its own, around its lookup and its store, never around the real
// compile, whose result it must not lose.
PJRT_Error* WrappedCompile(PJRT_Client_Compile_Args* args) {
  ++GlobalCounters().compiles;
  if (wrapper->cache == nullptr) {
    ++GlobalCounters().bypassed;
    return wrapper->real->PJRT_Client_Compile(args);
  }
  return wrapper->cache->Compile(args);
}

PJRT_Error* WrappedClientDestroy(PJRT_Client_Destroy_Args* args) {
  if (wrapper->cache != nullptr) wrapper->cache->ForgetClient(args->client);
  return wrapper->real->PJRT_Client_Destroy(args);
}

PJRT_Error* WrappedExecute(PJRT_LoadedExecutable_Execute_Args* args) {
  return ExecuteWithBridge(wrapper->real, args);
}

// Loads the real plugin into `w`, or says why it cannot be wrapped.
std::string LoadReal(Wrapper& w) {
  w.plugin_path = Env(kPluginEnv);
  w.plugin_from = kPluginEnv;
  if (w.plugin_path.empty()) {
    // <site-packages>/xlakit/_lib/ -> <site-packages>/libtpu/libtpu.so
    w.plugin_path = DirName(DirName(DirName(w.self_path))) + "/libtpu/libtpu.so";
    w.plugin_from = "default: the libtpu installed beside xlakit";
    struct stat st;
    if (stat(w.plugin_path.c_str(), &st) != 0) {
      return std::string(kPluginEnv) +
             " is unset and no libtpu is installed beside xlakit (" +
             w.plugin_path +
             "): set it to the real PJRT plugin this wrapper should load "
             "(libtpu.so, a CPU or GPU plugin), or pip install libtpu";
    }
  }
  if (SameFile(w.plugin_path, w.self_path)) {
    return std::string(kPluginEnv) + "=" + w.plugin_path +
           " is this wrapper itself: set it to the real plugin (e.g. libtpu.so)";
  }
  void* handle = dlopen(w.plugin_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return "cannot load the real plugin " + w.plugin_path + " (" + w.plugin_from +
           "): " + (why ? why : "dlopen failed") + "; set " + kPluginEnv +
           " to a PJRT plugin's path";
  }
  using GetApi = const PJRT_Api* (*)();
  auto get = reinterpret_cast<GetApi>(dlsym(handle, "GetPjrtApi"));
  if (get == nullptr) {
    return w.plugin_path + " is not a PJRT plugin (it exports no GetPjrtApi); "
           "set " + kPluginEnv + " to a PJRT plugin such as libtpu.so";
  }
  const PJRT_Api* real = get();
  if (real == nullptr) {
    return "the real plugin " + w.plugin_path + " returned no PJRT_Api";
  }
  const int major = real->pjrt_api_version.major_version;
  const int minor = real->pjrt_api_version.minor_version;
  if (major != PJRT_API_MAJOR) {
    return "the real plugin " + w.plugin_path + " implements PJRT C API " +
           ApiVersion(major, minor) + ", and this wrapper was built for " +
           ApiVersion(PJRT_API_MAJOR, PJRT_API_MINOR) +
           ": another major version lays its structs out differently, so it "
           "cannot be wrapped; use an xlakit built for C API " +
           std::to_string(major) + ".x, or load the plugin without the wrapper";
  }
  if (real->struct_size < offsetof(PJRT_Api, PJRT_LoadedExecutable_Execute) +
                              sizeof(void*)) {
    return "the real plugin " + w.plugin_path + "'s PJRT_Api is too small (" +
           std::to_string(real->struct_size) + " bytes) to be a C API " +
           ApiVersion(major, minor) + " table";
  }
  w.real = real;
  return "";
}

const PJRT_Api* Activate() {
  wrapper = new Wrapper();  // lives as long as the process: the framework keeps the table
  Wrapper& w = *wrapper;
  Dl_info self;
  if (dladdr(reinterpret_cast<void*>(&GetPjrtApi), &self) && self.dli_fname) {
    w.self_path = self.dli_fname;
  }
  w.refused = LoadReal(w);
  if (!w.refused.empty()) {
    Log(w.refused);
    return RefusingApi(w.refused);
  }
  CacheConfig cfg;
  cfg.dir = CacheDir(&cfg.env_problem);
  cfg.plugin_path = w.plugin_path;
  cfg.read_only = Flag(kCacheReadOnlyEnv, &cfg.env_problem);
  cfg.trust_shared = Flag(kTrustSharedEnv, &cfg.env_problem);
  cfg.key = Env(kCacheKeyEnv);
  cfg.max_entry_bytes =
      Bytes(kCacheMaxEntryBytesEnv, kDefaultMaxEntryBytes, &cfg.env_problem);
  cfg.min_compile_us = Micros(kCacheMinCompileSecondsEnv, &cfg.env_problem);
  if (!Env(kCacheMaxBytesEnv).empty()) {
    cfg.max_bytes = Bytes(kCacheMaxBytesEnv, kDefaultMaxEntryBytes,
                          &cfg.env_problem);
  }
  std::string explain_problem;  // a diagnostic: a mistyped value leaves it off
  cfg.explain = Flag(kCacheExplainEnv, &explain_problem);
  if (!explain_problem.empty()) Log(explain_problem + "; misses go unexplained");
  w.cache = CompileCache::Open(w.real, cfg, &w.cache_state);
  const size_t size = w.real->struct_size;
  w.table.reset(new char[size]);
  std::memcpy(w.table.get(), w.real, size);
  auto* table = reinterpret_cast<PJRT_Api*>(w.table.get());
  table->PJRT_Client_Compile = &WrappedCompile;
  table->PJRT_Client_Destroy = &WrappedClientDestroy;
  table->PJRT_LoadedExecutable_Execute = &WrappedExecute;
  std::string problem;  // a mistyped value leaves the accounting on
  const bool accounting = Env(kMemoryAccountingEnv).empty() ||
                          Flag(kMemoryAccountingEnv, &problem) || !problem.empty();
  if (!problem.empty()) Log(problem + "; memory accounting stays on");
  InstallMemoryAccounting(w.real, table, accounting);
  std::string cache = w.cache ? "compile cache " + w.cache_state.dir + " (" +
                                    w.cache_state.folder +
                                    (w.cache_state.authenticated
                                         ? ", authenticated" : "") +
                                    (w.cache_state.read_only ? ", read-only"
                                                             : "") + ")"
                              : "compile cache off: " + w.cache_state.why_off;
  Log("wrapping " + w.plugin_path + " (PJRT C API " +
      ApiVersion(w.real->pjrt_api_version.major_version,
                 w.real->pjrt_api_version.minor_version) +
      "); " + cache);
  return table;
}

// Activate, or (no memory to start) a table that refuses with the reason,
// or without one if even that cannot be made: an error for the framework to
// report, never an abort.
const PJRT_Api* ActivateOrRefuse() {
  try {
    return Activate();
  } catch (...) {
  }
  try {
    const std::string why =
        "the wrapper ran out of memory while starting (loading " +
        (wrapper ? wrapper->plugin_path : std::string("the real plugin")) +
        "); free memory, or load the plugin without the wrapper";
    if (wrapper != nullptr) {
      wrapper->refused = why;
      wrapper->real = nullptr;
      wrapper->cache.reset();
    }
    Log(why);
    return RefusingApi(why);
  } catch (...) {
    std::fputs("xlakit-pjrt: out of memory while starting\n", stderr);
    return OutOfMemoryApi();
  }
}

std::string StatusJson() {
  Counters& c = GlobalCounters();
  auto str = [](const std::string& s) { return JsonString(s); };
  auto opt = [](const std::string& s) {
    return s.empty() ? std::string("null") : JsonString(s);
  };
  std::string out = "{\"wrapper_version\": " + str(kWrapperVersion) +
                    ", \"built_api\": " +
                    str(ApiVersion(PJRT_API_MAJOR, PJRT_API_MINOR));
  const Wrapper* w = wrapper;
  out += std::string(", \"active\": ") + (w && w->real ? "true" : "false");
  if (w != nullptr) {
    out += ", \"plugin\": " + opt(w->plugin_path) + ", \"plugin_from\": " +
           opt(w->plugin_from) + ", \"refused\": " + opt(w->refused);
    out += ", \"plugin_api\": " +
           (w->real ? str(ApiVersion(w->real->pjrt_api_version.major_version,
                                     w->real->pjrt_api_version.minor_version))
                    : std::string("null"));
    const CacheState& s = w->cache_state;
    out += ", \"cache\": {\"dir\": " + opt(s.dir) + ", \"on\": " +
           (s.on ? "true" : "false") + ", \"why_off\": " + opt(s.why_off) +
           ", \"read_only\": " + (s.read_only ? "true" : "false") +
           ", \"authenticated\": " + (s.authenticated ? "true" : "false") +
           ", \"folder\": " + opt(s.folder) + "}";
  }
  out += ", \"counts\": {\"compiles\": " + std::to_string(c.compiles) +
         ", \"hits\": " + std::to_string(c.hits) +
         ", \"misses\": " + std::to_string(c.misses) +
         ", \"bypassed\": " + std::to_string(c.bypassed) +
         ", \"writes\": " + std::to_string(c.writes) +
         ", \"write_failures\": " + std::to_string(c.write_failures) +
         ", \"serialize_failures\": " + std::to_string(c.serialize_failures) +
         ", \"execute_options_padded\": " +
         std::to_string(c.execute_options_padded) +
         ", \"flight_waits\": " + std::to_string(c.flight_waits) +
         ", \"evictions\": " + std::to_string(c.evictions) +
         ", \"skipped_fast\": " + std::to_string(c.skipped_fast) +
         ", \"internal_errors\": " + std::to_string(c.internal_errors) +
         ", \"compile_s\": " + std::to_string(c.compile_us / 1e6) +
         ", \"load_s\": " + std::to_string(c.load_us / 1e6) + "}";
  out += ", \"refused_entries\": {";
  bool first = true;
  for (const auto& [reason, n] : c.RefusedByReason()) {
    out += (first ? "" : ", ") + str(reason) + ": " + std::to_string(n);
    first = false;
  }
  return out + "}}";
}

// Writes `make()`'s JSON into `buffer` (at most `capacity` bytes,
// NUL-terminated) and returns its full length, like snprintf; without memory
// to make it, a JSON object saying so.
template <typename Make>
size_t CopyJson(Make make, char* buffer, size_t capacity) {
  static const char kOutOfMemory[] = "{\"error\": \"out of memory\"}";
  std::string json;
  const char* data = kOutOfMemory;
  size_t size = sizeof(kOutOfMemory) - 1;
  try {
    json = make();
    data = json.data();
    size = json.size();
  } catch (...) {
  }
  if (buffer != nullptr && capacity > 0) {
    const size_t n = size < capacity - 1 ? size : capacity - 1;
    std::memcpy(buffer, data, n);
    buffer[n] = '\0';
  }
  return size;
}

}  // namespace
}  // namespace pjrt_wrap
}  // namespace xlakit

XLAKIT_EXPORT const PJRT_Api* GetPjrtApi() {
  static const PJRT_Api* api = xlakit::pjrt_wrap::ActivateOrRefuse();
  return api;
}

// The wrapper's state as one JSON object (xlakit.pjrt_wrap reads it with
// ctypes): writes at most `capacity` bytes (NUL-terminated) and returns the
// full length, like snprintf.
XLAKIT_EXPORT size_t xlakit_pjrt_wrap_status(char* buffer, size_t capacity) {
  return xlakit::pjrt_wrap::CopyJson(
      [] { return xlakit::pjrt_wrap::StatusJson(); }, buffer, capacity);
}

// Memory per device of every client the wrapper wraps, as one JSON object
// (memory_accounting.h; xlakit.runtime.wrap_memory reads it with ctypes).
// `flags` bit 0: ask the plugin's PJRT_Device_MemoryStats too; bit 1: reset
// each device's peak to its live bytes after reading. Returns the full
// length, like xlakit_pjrt_wrap_status.
XLAKIT_EXPORT size_t xlakit_pjrt_wrap_memory(char* buffer, size_t capacity,
                                             int flags) {
  return xlakit::pjrt_wrap::CopyJson(
      [flags] {
        return xlakit::pjrt_wrap::MemoryJson((flags & 1) != 0,
                                             (flags & 2) != 0);
      },
      buffer, capacity);
}

// The bytes a cache key hashes for a program of `format` (proto_canon.h
// CanonicalProgram: the input itself where it does not read as expected), so
// that the key's canonicalisation is tested as built here, against parsers
// (tests/runtime/test_key_differential.py). Writes at most `capacity` bytes
// (not NUL-terminated: they hold NULs) and returns the full length; SIZE_MAX
// if it could not be made (no memory).
XLAKIT_EXPORT size_t xlakit_pjrt_wrap_canonical_program(
    const char* format, size_t format_size, const char* program,
    size_t program_size, char* buffer, size_t capacity) {
  try {
    std::string out = xlakit::pjrt_wrap::CanonicalProgram(
        std::string_view(format, format_size),
        std::string_view(program, program_size));
    if (buffer != nullptr) {
      std::memcpy(buffer, out.data(), std::min(out.size(), capacity));
    }
    return out.size();
  } catch (...) {
    return SIZE_MAX;
  }
}
