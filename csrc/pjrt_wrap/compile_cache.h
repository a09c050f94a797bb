// The compile cache behind the wrapped PJRT_Client_Compile.
//
// An entry's name is the SHA-256 (hex) of everything the executable depends
// on: the program (its format and bytes), the serialized compile options
// (both with map entries in a canonical order and an HLO module without its
// source locations, proto_canon.h), the real
// plugin's build (the SHA-256 of its file and its C API version: two builds
// report the same platform strings), its platform name and version, the
// environment that changes its code (key_parts.h: the compiler flags it reads
// from the environment, normalised, and env.h kKeyedCodegenEnvs), the
// topology (pjrt_calls.h DescribeTopology: the plugin's serialized topology
// description, the device kinds and counts; nothing host-specific, so the
// hosts of a pod share one entry per program), the wrapper's own version, and the id of the job's key
// (XLAKIT_CACHE_KEY) if it has one, so jobs with different keys, or none,
// never use or replace each other's entries. The entry is xlakit's envelope (core/envelope.h: checksum;
// HMAC-SHA256 tag under the key; the entry's name stored in it and compared
// on load, so a renamed or swapped entry is refused, and under the key the
// tag covers the name) around PJRT_Executable_Serialize's bytes,
// written by core/atomic_file.h (temporary, fsync, rename; owner-only modes)
// into a folder core/folder_trust.h accepts.
//
// A hit loads with PJRT_Executable_DeserializeAndLoad and never calls the real
// compile. Beside each entry it writes goes a record of its key's parts
// (key_record.h), which explains later misses; with kCacheExplainEnv set, each
// miss logs what differed from the nearest entry of the same module. Anything
// else (no entry; corrupt, truncated, foreign, other
// platform, bad or missing tag; a plugin that cannot deserialize or serialize;
// an unwritable or full disk) is counted and falls back to the real compile,
// whose result replaces a refused entry. Nothing here fails a compile, throws
// or aborts.
#ifndef XLAKIT_PJRT_WRAP_COMPILE_CACHE_H_
#define XLAKIT_PJRT_WRAP_COMPILE_CACHE_H_

#include <pthread.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/envelope.h"
#include "core/folder_trust.h"
#include "pjrt_wrap/env.h"
#include "pjrt_wrap/key_record.h"
#include "pjrt_wrap/libcrypto.h"
#include "xla/pjrt/c/pjrt_c_api.h"

namespace xlakit {
namespace pjrt_wrap {

// The wrapper's own version: part of every key and of every entry's identity.
// Bump it when what a key covers, or what an entry holds, changes.
inline constexpr char kWrapperVersion[] = "3";

struct CacheConfig {
  std::string dir;
  std::string plugin_path;  // the real plugin's file, hashed into every key
  bool read_only = false;
  bool trust_shared = false;
  std::string key;  // XLAKIT_CACHE_KEY; "" for plain entries
  // Larger entries are refused unread and not written (env.h).
  uint64_t max_entry_bytes = kDefaultMaxEntryBytes;
  // The folder's bound (env.h kCacheMaxBytesEnv); 0 for none.
  uint64_t max_bytes = 0;
  // Compiles faster than this are not written (env.h
  // kCacheMinCompileSecondsEnv).
  uint64_t min_compile_us = 0;
  // Log why each miss missed (env.h kCacheExplainEnv).
  bool explain = false;
  // A variable the cache reads holds a value it cannot use (a mistyped flag):
  // what is wrong, naming the variable and its value; the cache then stays off.
  std::string env_problem;
};

// What `xlakit_pjrt_wrap_status` reports of the cache.
struct CacheState {
  std::string dir;
  bool on = false;
  std::string why_off;
  bool read_only = false;
  bool authenticated = false;
  std::string folder;  // folder_trust state
};

class CompileCache {
 public:
  // The cache for `cfg`, or nullptr with `state->why_off` set: no folder
  // given, a folder others can write, one that cannot be made, no libcrypto,
  // a key too short to be a secret, a plugin without (de)serialization or
  // whose file cannot be read.
  static std::unique_ptr<CompileCache> Open(const PJRT_Api* real,
                                            const CacheConfig& cfg,
                                            CacheState* state);

  // PJRT_Client_Compile through the cache; the real compile's error, if any.
  PJRT_Error* Compile(PJRT_Client_Compile_Args* args);

  // Forget what was learned about a client the framework destroys.
  void ForgetClient(PJRT_Client* client);

 private:
  struct ClientInfo {
    bool ok = false;
    std::string error;
    RuntimeIdentity self;
    std::string topology;         // pjrt_calls.h DescribeTopology
    std::string topology_source;  // "topology+devices" or "devices"
  };

  // Single flight: the keys a thread of this process is looking up or
  // compiling now; another thread asking for one waits for it, then looks
  // the entry up again (a hit once the first wrote it).
  // A pthread condition, not std::condition_variable, whose wait needs
  // GLIBCXX_3.4.30 (GCC 12) where the library promises 3.4.21.
  struct Flight {
    bool done = false;
    pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
    ~Flight() { pthread_cond_destroy(&cv); }
  };
  // What a compile learned before the real compile: the client, the key and
  // the entry's path ("" when the program cannot be keyed), the flight it
  // holds, and at a miss the key's parts.
  struct CompileLookup {
    ClientInfo info;
    std::string key;
    std::string path;
    std::shared_ptr<Flight> flight;
    KeyRecord record;
  };

  CompileCache(const PJRT_Api* real, CacheConfig cfg, const Libcrypto& crypto);
  // Keys the program, takes its flight and looks its entry up: true on a hit
  // (`args->executable` set). May throw (no memory): Compile then compiles.
  bool Lookup(PJRT_Client_Compile_Args* args, CompileLookup* out);
  void EndFlight(const std::string& key,
                 const std::shared_ptr<Flight>& flight) noexcept;
  ClientInfo Info(PJRT_Client* client);
  std::string KeyFor(const ClientInfo& info,
                     const PJRT_Client_Compile_Args& args);
  // What the key of this compile was made of (key_record.h): only at a miss.
  KeyRecord RecordFor(const ClientInfo& info,
                      const PJRT_Client_Compile_Args& args);
  std::unique_ptr<EntryMac> NewMac() const;
  // Removes the least recently used entries but `keep` until the folder's
  // entries hold at most cfg_.max_bytes, and the temporaries of writers
  // killed more than 15 minutes ago.
  void Evict(const std::string& keep);
  // True when `args->executable` now holds the cached executable.
  bool TryLoad(const ClientInfo& info, const std::string& key,
               const std::string& path, PJRT_Client_Compile_Args* args);
  void Store(const ClientInfo& info, const std::string& key,
             const std::string& path, PJRT_LoadedExecutable* executable,
             const KeyRecord& record);

  const PJRT_Api* real_;
  const CacheConfig cfg_;
  const Libcrypto& crypto_;
  std::string key_id_;
  // What the executables also depend on, fixed for the process: the real
  // plugin's build (SHA-256 of its file, its C API version) and the compiler
  // flags it reads from the environment.
  std::string plugin_build_;
  std::string flags_;
  // The same environment by variable, for key records.
  std::vector<std::pair<std::string, std::string>> flag_parts_;
  std::string codegen_env_;
  std::mutex mu_;
  std::map<PJRT_Client*, ClientInfo> clients_;
  std::mutex flight_mu_;
  std::map<std::string, std::shared_ptr<Flight>> in_flight_;
};

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_COMPILE_CACHE_H_
