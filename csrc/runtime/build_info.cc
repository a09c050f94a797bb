// Provenance of the running binary; see build_info.h.
#include "torch_xla/csrc/runtime/xlakit/build_info.h"

#include "torch_xla/csrc/runtime/xlakit/build_info_generated.h"

namespace torch_xla {
namespace runtime {
namespace xlakit {

const BuildInfo& GetBuildInfo() {
  static const BuildInfo* info = [] {
    auto* b = new BuildInfo();
    b->patch_set = XLAKIT_PATCH_SET;
    b->patches = {XLAKIT_PATCHES};
    b->series_sha256 = XLAKIT_SERIES_SHA256;
    b->sources_sha256 = XLAKIT_SOURCES_SHA256;
    b->torch_xla_commit = XLAKIT_TORCH_XLA_COMMIT;
    b->xla_commit = XLAKIT_XLA_COMMIT;
    return b;
  }();
  return *info;
}

std::string PatchSeriesId() {
  const BuildInfo& info = GetBuildInfo();
  return info.patch_set + ":" + info.sources_sha256;
}

}  // namespace xlakit
}  // namespace runtime
}  // namespace torch_xla
