// Provenance of the running binary; see build_info.h.
#include "torch_xla/csrc/runtime/xlakit/build_info.h"

#include "torch_xla/csrc/runtime/xlakit/build_info_generated.h"

namespace torch_xla {
namespace runtime {
namespace xlakit {

const BuildInfo& GetBuildInfo() {
  static const BuildInfo* info = new BuildInfo{
      XLAKIT_PATCH_SET,
      {XLAKIT_PATCHES},
      XLAKIT_SERIES_SHA256,
      XLAKIT_TORCH_XLA_COMMIT,
      XLAKIT_XLA_COMMIT,
  };
  return *info;
}

std::string PatchSeriesId() {
  const BuildInfo& info = GetBuildInfo();
  return info.patch_set + ":" + info.series_sha256;
}

}  // namespace xlakit
}  // namespace runtime
}  // namespace torch_xla
