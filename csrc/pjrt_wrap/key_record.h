// What a cache entry's key was made of, recorded beside the entry, so that a
// miss can be explained: which part differs from the nearest entry of the
// same module (the flags, the plugin build, the topology, the program, or
// only the program's constants).
//
// The record is a small sidecar file, `<entry>.parts.json`, written
// atomically (core/atomic_file.h) after its entry, not inside the envelope:
// it is read by diagnostics only (the wrapper's miss log, `xlakit cache
// explain`), never trusted for loading and never needed to load (a missing or
// junk one costs an explanation, not a hit), and the tools can read every
// record of a folder without reading (or verifying) multi-GB entries. The
// envelope and the key are unchanged: the parts are recorded, not keyed, so
// kWrapperVersion stays. Each part is a hash (SHA-256, the first 32 hex
// digits) of what the key covers; details say the parts in words where that
// is not secret: the normalised XLA_FLAGS and TF_XLA_FLAGS, the codegen
// variables, the plugin build and platform. LIBTPU_INIT_ARGS is hashed only
// (it may hold secrets); the cache key appears only as its id.
//
// Format (python/xlakit/runtime/cache_explain.py reads it too): one JSON
// object, one field per line:
//   {"format": "xlakit-pjrt-key-parts/1", "entry": KEY, "module": NAME,
//    "program_format": F, "written_unix_s": N,
//    "parts": {NAME: HASH, ...}, "details": {NAME: TEXT, ...}}
#ifndef XLAKIT_PJRT_WRAP_KEY_RECORD_H_
#define XLAKIT_PJRT_WRAP_KEY_RECORD_H_

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pjrt_wrap/libcrypto.h"

// xla/pjrt/c/pjrt_c_api.h, which only the plugin is built with (xlakit._C
// reads this header's names).
struct PJRT_Client_Compile_Args;

namespace xlakit {
namespace pjrt_wrap {

inline constexpr char kPartsSuffix[] = ".parts.json";
inline constexpr char kPartsFormat[] = "xlakit-pjrt-key-parts/1";
// Larger files under a record's name are not records (one is ~1.5 KB).
inline constexpr size_t kMaxPartsBytes = 64 << 10;

struct KeyRecord {
  std::string module = "unknown";
  std::string program_format;
  // (name, hash) in the order a miss is explained; "program_without_constants"
  // only for HLO.
  std::vector<std::pair<std::string, std::string>> parts;
  // (name, words): what a part was, where it may be shown.
  std::vector<std::pair<std::string, std::string>> details;

  // The value named `name` of `parts` (or `details`), "" if absent.
  std::string Part(const std::string& name) const;
  std::string Detail(const std::string& name) const;
};

// What a record covers besides the compile's arguments: the process's and the
// client's parts of the key (compile_cache.h).
struct KeyRecordInputs {
  std::string plugin_build;
  const std::vector<std::pair<std::string, std::string>>* flags = nullptr;
  std::string codegen_env;  // key_parts.h KeyedCodegenEnvironment
  std::string platform_name;
  std::string platform_version;
  std::string topology;
  std::string topology_source;
  std::string key_id;  // "" without a key
};

// The record of a compile's key: hashes the program (canonical, and without
// its constants for HLO) and the compile options again, so it is made only at
// a miss.
KeyRecord MakeKeyRecord(const Libcrypto& crypto, const KeyRecordInputs& in,
                        const PJRT_Client_Compile_Args& args);

// The sidecar's contents for the entry named `entry`.
std::string KeyRecordJson(const KeyRecord& record, const std::string& entry);

// Reads a sidecar written by KeyRecordJson; false for anything else (junk,
// another format, a record of another entry than `entry`).
bool ParseKeyRecord(std::string_view json, const std::string& entry,
                    KeyRecord* record);

// The parts in which `mine` differs from `other`, each in words (the flags
// that differ, "only the program's constants: ..." for the constant trap).
std::vector<std::string> Differences(const KeyRecord& mine,
                                     const KeyRecord& other);

// One line for a miss of `mine` (key `key`): its module and, against the
// nearest record of the same module in `dir` (fewest differing parts, then
// the newest), what differed; or that the folder has no entry of it yet.
// Reads every record in `dir`: only when XLAKIT_PJRT_CACHE_EXPLAIN is set.
std::string ExplainMiss(const KeyRecord& mine, const std::string& dir,
                        const std::string& key);

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_KEY_RECORD_H_
