// Python bindings for transfer batch planning.
// Python.h (through bindings.h) comes first, as CPython requires.
#include "bindings.h"

#include <string>
#include <vector>

#include "core/batch_plan.h"

namespace xlakit {
namespace {

py::Ref PlanBatches(PyObject* args, PyObject* kwargs) {
  static const char* kNames[] = {"item_bytes", "max_inflight_bytes", nullptr};
  PyObject *item_bytes = nullptr, *max_inflight_bytes = nullptr;
  py::Parse(args, kwargs, "O|$O", kNames, &item_bytes, &max_inflight_bytes);
  std::vector<TransferBatch> batches;
  std::string error = PlanTransferBatches(
      py::Int64List(item_bytes, "item_bytes"),
      py::Int64(max_inflight_bytes, "max_inflight_bytes"), &batches);
  if (!error.empty()) py::Raise(PyExc_ValueError, error);
  std::vector<py::Ref> out;
  out.reserve(batches.size());
  for (const TransferBatch& b : batches) {
    out.push_back(py::Tuple(py::UInt(b.begin), py::UInt(b.end), py::Int(b.bytes)));
  }
  return py::List(std::move(out));
}

PyMethodDef kMethods[] = {
    py::Method<PlanBatches>(
        "plan_transfer_batches",
        "plan_transfer_batches(item_bytes, *, max_inflight_bytes) -> "
        "[(begin, end, bytes), ...]"),
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void BindTransfer(PyObject* m) { py::AddFunctions(m, kMethods); }

}  // namespace xlakit
