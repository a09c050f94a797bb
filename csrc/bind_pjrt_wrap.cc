// The PJRT wrapping plugin's environment names (pjrt_wrap/env.h), for
// python/xlakit/_knobs.py: the plugin and Python read one spelling of each.
#include "bindings.h"
#include "pjrt_wrap/env.h"
#include "pjrt_wrap/key_record.h"

namespace xlakit {

void BindPjrtWrap(PyObject* m) {
  py::AddStr(m, "PJRT_PLUGIN_ENV", pjrt_wrap::kPluginEnv);
  py::AddStr(m, "PJRT_CACHE_DIR_ENV", pjrt_wrap::kCacheDirEnv);
  py::AddStr(m, "PJRT_CACHE_READ_ONLY_ENV", pjrt_wrap::kCacheReadOnlyEnv);
  py::AddStr(m, "PJRT_MEMORY_ACCOUNTING_ENV", pjrt_wrap::kMemoryAccountingEnv);
  py::AddStr(m, "CACHE_TRUST_SHARED_ENV", pjrt_wrap::kTrustSharedEnv);
  py::AddStr(m, "PJRT_CACHE_MAX_ENTRY_BYTES_ENV",
             pjrt_wrap::kCacheMaxEntryBytesEnv);
  py::AddStr(m, "PJRT_CACHE_MAX_BYTES_ENV", pjrt_wrap::kCacheMaxBytesEnv);
  py::AddStr(m, "PJRT_CACHE_EXPLAIN_ENV", pjrt_wrap::kCacheExplainEnv);
  py::AddStr(m, "PJRT_PARTS_SUFFIX", pjrt_wrap::kPartsSuffix);
  py::AddStr(m, "PJRT_PARTS_FORMAT", pjrt_wrap::kPartsFormat);
  py::AddInt(m, "PJRT_DEFAULT_MAX_ENTRY_BYTES",
             pjrt_wrap::kDefaultMaxEntryBytes);
}

}  // namespace xlakit
