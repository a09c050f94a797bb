// The environment's part of a cache key, normalised: what changes the code a
// plugin generates, and nothing that only changes what it logs or dumps.
//
// Each variable of env.h kKeyedFlagEnvs is split into whitespace-separated
// flags. A flag file (--flagfile=PATH, -flagfile=PATH, or --flagfile PATH;
// for absl's comma-separated lists, the list as one name and each file of
// it) is replaced by the SHA-256 of the file's contents and, recursively, of
// the flag files those name (the flags in them count; where the files lie
// does not; a missing file counts as absent). A flag file that cannot be
// keyed so (not a regular file: a FIFO, /dev/zero; over kMaxFlagFileBytes;
// unreadable; nested deeper than kMaxFlagFileDepth) is a problem: the cache
// stays off rather than key flags it cannot see, and nothing blocks or reads
// without end. When every flag has
// the plain form (starts with '-'; for LIBTPU_INIT_ARGS, which absl parses and
// where `--flag value` takes the next word, also holds a '=') and none is a
// flag file, the dump and logging flags are dropped (--xla_dump_*, --v,
// --vmodule, --log_dir, --logtostderr, ...) and the rest sorted by name,
// stably, so two settings of one flag (`--x=1 --x=2`, `--x --nox`) keep their
// order, which decides the value. Anything else (quotes, a bare word, a flag
// file) is kept as written: a possible miss, never two settings one key.
// Each variable of env.h kKeyedCodegenEnvs is keyed as it is (unset apart
// from empty).
#ifndef XLAKIT_PJRT_WRAP_KEY_PARTS_H_
#define XLAKIT_PJRT_WRAP_KEY_PARTS_H_

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "pjrt_wrap/libcrypto.h"

namespace xlakit {
namespace pjrt_wrap {

inline constexpr size_t kMaxFlagFileBytes = size_t{1} << 20;
inline constexpr int kMaxFlagFileDepth = 8;

// One variable's flags, normalised as above. `absl_style`: LIBTPU_INIT_ARGS.
// A flag file that cannot be keyed sets *problem.
std::string NormalizedFlags(const Libcrypto& crypto, const std::string& value,
                            bool absl_style, std::string* problem);

// Each variable of env.h kKeyedFlagEnvs with its normalised flags; the first
// flag file that cannot be keyed sets *problem, naming the variable.
std::vector<std::pair<std::string, std::string>> KeyedFlags(
    const Libcrypto& crypto, std::string* problem);

// The variables of env.h kKeyedCodegenEnvs, one `NAME=value` (or
// `NAME unset`) line each.
std::string KeyedCodegenEnvironment();

// The text every key of this process hashes for its environment: the two
// above, in that order.
std::string KeyedEnvironment(const Libcrypto& crypto, std::string* problem);

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_KEY_PARTS_H_
