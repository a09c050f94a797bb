// The environment's part of a cache key, normalised: what changes the code a
// plugin generates, and nothing that only changes what it logs or dumps.
//
// Each variable of env.h kKeyedFlagEnvs is split into whitespace-separated
// flags. A --flagfile=PATH is replaced by the SHA-256 of the file's contents
// (the flags in it count; where the file lies does not). When every flag has
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

#include <string>
#include <utility>
#include <vector>

#include "pjrt_wrap/libcrypto.h"

namespace xlakit {
namespace pjrt_wrap {

// One variable's flags, normalised as above. `absl_style`: LIBTPU_INIT_ARGS.
std::string NormalizedFlags(const Libcrypto& crypto, const std::string& value,
                            bool absl_style);

// Each variable of env.h kKeyedFlagEnvs with its normalised flags.
std::vector<std::pair<std::string, std::string>> KeyedFlags(
    const Libcrypto& crypto);

// The variables of env.h kKeyedCodegenEnvs, one `NAME=value` (or
// `NAME unset`) line each.
std::string KeyedCodegenEnvironment();

// The text every key of this process hashes for its environment: the two
// above, in that order.
std::string KeyedEnvironment(const Libcrypto& crypto);

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_KEY_PARTS_H_
