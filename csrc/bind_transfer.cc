// Python bindings for transfer batch planning.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>
#include <vector>

#include "bindings.h"
#include "core/batch_plan.h"

namespace py = pybind11;

namespace xlakit {

void BindTransfer(py::module_& m) {
  m.def(
      "plan_transfer_batches",
      [](const std::vector<int64_t>& item_bytes, int64_t max_inflight_bytes) {
        std::vector<TransferBatch> batches;
        std::string error =
            PlanTransferBatches(item_bytes, max_inflight_bytes, &batches);
        if (!error.empty()) throw py::value_error(error);
        std::vector<std::tuple<size_t, size_t, int64_t>> out;
        out.reserve(batches.size());
        for (const TransferBatch& b : batches) {
          out.emplace_back(b.begin, b.end, b.bytes);
        }
        return out;
      },
      py::arg("item_bytes"), py::kw_only(), py::arg("max_inflight_bytes"));
}

}  // namespace xlakit
