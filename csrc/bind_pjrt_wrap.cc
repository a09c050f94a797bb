// The PJRT wrapping plugin's environment names (pjrt_wrap/env.h), for
// python/xlakit/_knobs.py: the plugin and Python read one spelling of each.
#include <pybind11/pybind11.h>

#include "bindings.h"
#include "pjrt_wrap/env.h"
#include "pjrt_wrap/key_record.h"

namespace xlakit {

void BindPjrtWrap(pybind11::module_& m) {
  m.attr("PJRT_PLUGIN_ENV") = pjrt_wrap::kPluginEnv;
  m.attr("PJRT_CACHE_DIR_ENV") = pjrt_wrap::kCacheDirEnv;
  m.attr("PJRT_CACHE_READ_ONLY_ENV") = pjrt_wrap::kCacheReadOnlyEnv;
  m.attr("PJRT_MEMORY_ACCOUNTING_ENV") = pjrt_wrap::kMemoryAccountingEnv;
  m.attr("CACHE_TRUST_SHARED_ENV") = pjrt_wrap::kTrustSharedEnv;
  m.attr("PJRT_CACHE_MAX_ENTRY_BYTES_ENV") = pjrt_wrap::kCacheMaxEntryBytesEnv;
  m.attr("PJRT_CACHE_MAX_BYTES_ENV") = pjrt_wrap::kCacheMaxBytesEnv;
  m.attr("PJRT_CACHE_EXPLAIN_ENV") = pjrt_wrap::kCacheExplainEnv;
  m.attr("PJRT_PARTS_SUFFIX") = pjrt_wrap::kPartsSuffix;
  m.attr("PJRT_PARTS_FORMAT") = pjrt_wrap::kPartsFormat;
  m.attr("PJRT_DEFAULT_MAX_ENTRY_BYTES") = pjrt_wrap::kDefaultMaxEntryBytes;
}

}  // namespace xlakit
