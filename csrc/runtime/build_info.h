// Provenance of the running binary: the patch set, the applied patches in
// series order, the series hash and the upstream commits. The values come
// from build_info_generated.h, which build/xlakit_build.py (`stamp`) writes
// into the tree before bazel runs; a checkout without it fails to compile
// rather than report made-up provenance.
#ifndef XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_BUILD_INFO_H_
#define XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_BUILD_INFO_H_

#include <string>
#include <vector>

namespace torch_xla {
namespace runtime {
namespace xlakit {

struct BuildInfo {
  std::string patch_set;  // e.g. "xlakit1"
  std::vector<std::string> patches;
  std::string series_sha256;
  // sha256 over the series, every csrc/ file placed into the tree and the
  // upstream commits: what this binary's xlakit code was built from.
  std::string sources_sha256;
  std::string torch_xla_commit;
  std::string xla_commit;
};

const BuildInfo& GetBuildInfo();

// "<patch_set>:<sources_sha256>", written into cache entries and cache keys:
// a change to a patch, to xlakit's placed C++ or to a pin gives new keys.
std::string PatchSeriesId();

}  // namespace xlakit
}  // namespace runtime
}  // namespace torch_xla

#endif  // XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_BUILD_INFO_H_
