// PJRT_LoadedExecutable_Execute for a framework older than the plugin.
//
// A plugin refuses an argument struct smaller than the one it was built with
// ("Unexpected PJRT_ExecuteOptions size: expected 112, got 80"): the stock
// torch_xla 2.9 wheel passes an 80-byte PJRT_ExecuteOptions, which every
// plugin built since C API 0.78 refuses. The fields added since (a call
// location, task ids for multi-task execution) mean "none" when zero, so the
// wrapper passes a zero-padded copy of this header's size instead: a call the
// plugin would refuse then runs as the framework meant it; a plugin that
// accepts the smaller struct reads the same values. Counted
// (execute_options_padded). Options the framework made at least this large
// pass untouched.
//
// Only for plugins up to kBridgeTestedUpToMinor: stock torch_xla 2.9 runs on
// xla-cpu-pjrt (C API 0.81) this way (tests/runtime/test_pjrt_wrap.py), but hangs in
// its second execution on a C API 0.115 plugin, padded or not. Past the
// tested range the options pass as they are and the plugin's own refusal
// stands (said once on stderr): a clear error rather than a hang.
#ifndef XLAKIT_PJRT_WRAP_EXECUTE_BRIDGE_H_
#define XLAKIT_PJRT_WRAP_EXECUTE_BRIDGE_H_

#include "xla/pjrt/c/pjrt_c_api.h"

namespace xlakit {
namespace pjrt_wrap {

inline constexpr int kBridgeTestedUpToMinor = 81;

PJRT_Error* ExecuteWithBridge(const PJRT_Api* real,
                              PJRT_LoadedExecutable_Execute_Args* args);

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_EXECUTE_BRIDGE_H_
