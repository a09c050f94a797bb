// The environment the wrapping plugin reads, in one place (python/xlakit/
// _knobs.py reads these names from xlakit._C, which binds this header).
// Everything is read once, when the framework first calls GetPjrtApi.
#ifndef XLAKIT_PJRT_WRAP_ENV_H_
#define XLAKIT_PJRT_WRAP_ENV_H_

#include <cstddef>
#include <cstdint>

namespace xlakit {
namespace pjrt_wrap {

// The real PJRT plugin to wrap (libtpu.so, a CPU or GPU plugin). Default: the
// libtpu installed beside xlakit (<site-packages>/libtpu/libtpu.so).
inline constexpr char kPluginEnv[] = "XLAKIT_PJRT_PLUGIN";
// The compile cache folder; unset, the wrapper passes every call through.
inline constexpr char kCacheDirEnv[] = "XLAKIT_PJRT_CACHE_DIR";
// Load entries but write none (every worker but one sharing a folder).
inline constexpr char kCacheReadOnlyEnv[] = "XLAKIT_PJRT_CACHE_READ_ONLY";
// Accept a cache folder a group the user belongs to can write
// (core/folder_trust.h); the name Python's enable_persistent_cache reads too.
inline constexpr char kTrustSharedEnv[] = "XLAKIT_CACHE_TRUST_SHARED";
// The largest cache entry, in bytes, the wrapper reads or writes: a bigger
// file under an entry's name is refused once its header is read, before any
// of its payload is (a hit holds the payload in memory once). Default
// kDefaultMaxEntryBytes; a positive integer, else the cache stays off.
inline constexpr char kCacheMaxEntryBytesEnv[] =
    "XLAKIT_PJRT_CACHE_MAX_ENTRY_BYTES";
// The most bytes the cache folder's entries may hold together: after each
// write, the least recently used entries (a hit touches its entry) are
// removed until the rest fit. Unset: no bound. A positive integer, else the
// cache stays off.
inline constexpr char kCacheMaxBytesEnv[] = "XLAKIT_PJRT_CACHE_MAX_BYTES";
// Programs that compiled in less than this many seconds are not written
// (counted as skipped_fast). Default 0: every program is written, since a hit
// loads in about a millisecond where a compile takes far longer (measured in
// docs/runtime.md), and the size
// bound, not the compile time, is what keeps the folder small. A number of
// seconds (0 or more), else the cache stays off.
inline constexpr char kCacheMinCompileSecondsEnv[] =
    "XLAKIT_PJRT_CACHE_MIN_COMPILE_S";
// At each miss, log one line naming the module and what differed from the
// nearest recorded entry of it in the folder (key_record.h); it reads every
// record of the folder, so only when asked. A flag (1/0); a mistyped value is
// logged and leaves it off.
inline constexpr char kCacheExplainEnv[] = "XLAKIT_PJRT_CACHE_EXPLAIN";
// 2 GiB: serialized executables are protocol buffers, which cannot be larger.
inline constexpr uint64_t kDefaultMaxEntryBytes = uint64_t{2} << 30;
// Account live buffers per device (memory_accounting.h); 0 turns it off
// (the plugin's own statistics are still reported). Default on.
inline constexpr char kMemoryAccountingEnv[] = "XLAKIT_PJRT_MEMORY_ACCOUNTING";
// Compiler flags a plugin reads from the environment rather than from the
// compile options (torch_xla passes none there): part of every cache key.
// Normalised first (key_parts.h): flags sorted, dump and logging flags
// dropped, a --flagfile= replaced by the SHA-256 of its contents.
inline constexpr const char* kKeyedFlagEnvs[] = {"XLA_FLAGS", "TF_XLA_FLAGS",
                                                 "LIBTPU_INIT_ARGS"};
// Other variables the plugin reads that change the code it generates, the
// same on every host of a pod: part of every cache key, as they are. torch_xla
// 2.9 sets TPU_MEGACORE (v4) and the bounds (tpu.py); the host-specific ones
// it sets (TPU_VISIBLE_CHIPS, TPU_PROCESS_ADDRESSES, TPU_PROCESS_PORT,
// CLOUD_TPU_TASK_ID, TPU_WORKER_ID, TPU_WORKER_HOSTNAMES) choose which chips a
// process drives, not its code: the topology and the compile options' device
// assignment, both in the key, cover that, so they stay out.
inline constexpr const char* kKeyedCodegenEnvs[] = {
    "TPU_MEGACORE",        "TPU_ACCELERATOR_TYPE",
    "TPU_PROCESS_BOUNDS",  "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_HOST_BOUNDS",     "TPU_CHIPS_PER_HOST_BOUNDS"};

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_ENV_H_
