// Transfer batch planning: splits an ordered list of device-to-host copies
// into consecutive batches whose bytes stay under a cap. No XLA or torch
// headers: also compiled into xlakit._C and tested there.
#ifndef XLAKIT_CORE_BATCH_PLAN_H_
#define XLAKIT_CORE_BATCH_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

namespace xlakit {

// Items [begin, end) of the input, `bytes` their sum.
struct TransferBatch {
  size_t begin = 0;
  size_t end = 0;
  int64_t bytes = 0;
};

// Greedy, order-preserving: a batch is closed when the next item would push
// it over `max_inflight_bytes`. An item larger than the cap travels alone
// (it cannot be split here; the host buffer for it exists anyway), so every
// batch either respects the cap or holds exactly one item. Order is kept
// because callers report progress by item index.
//
// Returns an empty string on success, else a message naming the bad input.
std::string PlanTransferBatches(const std::vector<int64_t>& item_bytes,
                                int64_t max_inflight_bytes,
                                std::vector<TransferBatch>* batches);

}  // namespace xlakit

#endif  // XLAKIT_CORE_BATCH_PLAN_H_
