// Transfer batch planning; see batch_plan.h.
#include "batch_plan.h"

namespace xlakit {

std::string PlanTransferBatches(const std::vector<int64_t>& item_bytes,
                                int64_t max_inflight_bytes,
                                std::vector<TransferBatch>* batches) {
  batches->clear();
  if (max_inflight_bytes <= 0) {
    return "max_inflight_bytes must be positive, got " +
           std::to_string(max_inflight_bytes);
  }
  TransferBatch current;
  for (size_t i = 0; i < item_bytes.size(); ++i) {
    int64_t bytes = item_bytes[i];
    if (bytes < 0) {
      return "item " + std::to_string(i) + " has a negative size (" +
             std::to_string(bytes) + " bytes)";
    }
    // Subtraction form: current.bytes + bytes could overflow int64.
    bool fits = bytes <= max_inflight_bytes - current.bytes;
    if (current.end > current.begin && !fits) {
      batches->push_back(current);
      current = TransferBatch{i, i, 0};
    }
    current.end = i + 1;
    current.bytes += bytes;
  }
  if (current.end > current.begin) batches->push_back(current);
  return "";
}

}  // namespace xlakit
