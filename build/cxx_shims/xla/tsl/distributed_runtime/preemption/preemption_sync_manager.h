// xlakit cxx-check shim, declarations only: stands in for openxla's
// xla/tsl/distributed_runtime/preemption/preemption_sync_manager.h, which
// the TensorFlow wheels do not ship. The checked torch_xla files only hold
// a std::unique_ptr to it; never linked.
#ifndef XLAKIT_SHIM_PREEMPTION_SYNC_MANAGER_H_
#define XLAKIT_SHIM_PREEMPTION_SYNC_MANAGER_H_

namespace tsl {

class PreemptionSyncManager;

}  // namespace tsl

#endif  // XLAKIT_SHIM_PREEMPTION_SYNC_MANAGER_H_
