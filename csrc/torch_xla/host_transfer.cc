// Safe device-to-host transfer; see host_transfer.h.
//
// Waits use the PJRT future API as torch_xla c04e61c itself does
// (PjRtBuffer::ToLiteral(MutableLiteralBase*) -> xla::PjRtFuture<>,
// PjRtFuture<>::OnReady(absl::AnyInvocable<void(absl::Status)>)): OnReady
// plus absl::Notification::WaitForNotificationWithTimeout gives a bounded
// wait, which PjRtFuture::Await() does not.
#include "torch_xla/csrc/xlakit/host_transfer.h"

#include <algorithm>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "xla/literal.h"
#include "xla/shape_util.h"

#include "torch_xla/csrc/aten_xla_bridge.h"
#include "torch_xla/csrc/ops/device_data.h"
#include "torch_xla/csrc/runtime/pjrt_computation_client.h"
#include "torch_xla/csrc/runtime/runtime.h"
#include "torch_xla/csrc/runtime/xlakit/core/batch_plan.h"
#include "torch_xla/csrc/runtime/xlakit/core/device_string.h"
#include "torch_xla/csrc/runtime/xlakit/pjrt_access.h"
#include "torch_xla/csrc/runtime/xlakit/shard_layout.h"
#include "torch_xla/csrc/tensor_util.h"
#include "torch_xla/csrc/unwrap_data.h"
#include "torch_xla/csrc/xla_graph_executor.h"

namespace torch_xla {
namespace xlakit {
namespace {

using runtime::xlakit::DataPieces;
using runtime::xlakit::LocalShard;
using runtime::xlakit::PjRtAccess;
using runtime::xlakit::ShardRegion;

// A literal and its completion, shared with the OnReady callback: after a
// timeout the copy may still land, so the memory must outlive this call.
struct PendingCopy {
  xla::Literal literal;
  absl::Notification done;
  absl::Status status;
};

struct Piece {
  size_t tensor = 0;
  std::shared_ptr<xla::PjRtBuffer> buffer;
  // Where the piece goes: [start, start + extent) of the tensor, taken from
  // the start of the buffer (edge shards carry padding past the extent).
  // Empty: the buffer is the whole tensor.
  std::vector<int64_t> start;
  std::vector<int64_t> extent;
  int64_t bytes = 0;
};

std::string Describe(const at::Tensor& t, size_t i, size_t n) {
  return absl::StrCat("tensor ", i, " of ", n, " (shape [",
                      absl::StrJoin(t.sizes(), ", "), "], ",
                      c10::toString(t.scalar_type()), ")");
}

absl::Status Expired(std::string_view stage, const std::string& what,
                     int64_t bytes_done, double timeout_s) {
  return absl::DeadlineExceededError(absl::StrCat(
      "transfer to host ran past its ", timeout_s, " s deadline while ", stage,
      " ", what, "; ", bytes_done, " bytes were on the host"));
}

// Whether materialising `t` would run (and maybe compile) a computation: its
// data is missing or stale and its IR is not plain device data. The rule of
// XLAGraphExecutor::CollectSyncTensors, which picks the tensors a sync runs.
bool NeedsExecution(XLATensor& t) {
  bool stale = t.CurrentDataHandle() == nullptr ||
               (t.data()->view != nullptr && !t.data()->view->IsUpToDate());
  if (!stale) return false;
  torch::lazy::Value ir = t.CurrentIrValue();
  return ir && DeviceData::Cast(ir.node.get()) == nullptr;
}

// Placeholders get their buffers when the async execution finishes; there is
// no future to wait on, so poll with backoff until the deadline.
bool WaitForData(const runtime::ComputationClient::DataPtr& data,
                 absl::Time deadline) {
  absl::Duration pause = absl::Microseconds(100);
  while (!data->HasValue()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(std::min(pause, deadline - absl::Now()));
    pause = std::min(pause * 2, absl::Milliseconds(20));
  }
  return true;
}

}  // namespace

absl::StatusOr<std::vector<at::Tensor>> TransferToHost(
    const std::vector<at::Tensor>& tensors, int64_t max_inflight_bytes,
    double timeout_s) {
  if (!(timeout_s > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("timeout_s must be positive, got ", timeout_s));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  XLA_ASSIGN_OR_RETURN(std::vector<XLATensorPtr> xtensors,
                       bridge::GetXlaTensors(tensors));
  // Never compile here: a compile (or a hung one) cannot be bounded by the
  // deadline, and would make the copy fail at once with a misleading stage.
  // The caller materialises pending computations first (xlakit.save does, in
  // its own "sync" stage).
  std::vector<std::string> pending;
  for (size_t i = 0; i < xtensors.size(); ++i) {
    if (NeedsExecution(*xtensors[i])) {
      pending.push_back(Describe(tensors[i], i, tensors.size()));
    }
  }
  if (!pending.empty()) {
    size_t shown = std::min<size_t>(pending.size(), 3);
    return absl::FailedPreconditionError(absl::StrCat(
        pending.size(), " of ", tensors.size(),
        " tensors have pending computations (",
        absl::StrJoin(pending.begin(), pending.begin() + shown, "; "),
        pending.size() > shown ? "; ..." : "",
        "): _xla_transfer_to_host does not compile, so that its deadline "
        "bounds every wait; run them first (torch_xla.sync()), as "
        "xlakit.save does"));
  }
  // Host-only data is uploaded and device-data IR resolved; nothing compiles.
  XLAGraphExecutor::Get()->SyncTensorsGraph(&xtensors, {}, /*wait=*/true,
                                            /*sync_ltc_data=*/true);
  XLA_ASSIGN_OR_RETURN(runtime::ComputationClient * client,
                       runtime::GetComputationClient());
  auto* pjrt_client = dynamic_cast<runtime::PjRtComputationClient*>(client);
  if (pjrt_client == nullptr) {
    return absl::UnimplementedError(
        "_xla_transfer_to_host needs the PJRT runtime client");
  }

  std::vector<at::Tensor> results(tensors.size());
  std::vector<Piece> pieces;
  for (size_t i = 0; i < xtensors.size(); ++i) {
    // The handle as it is: GetXlaData() would throw on a placeholder whose
    // execution is still in flight; it is waited for, within the deadline.
    torch::lazy::BackendDataPtr handle = xtensors[i]->CurrentDataHandle();
    runtime::ComputationClient::DataPtr data =
        UnwrapXlaData(handle != nullptr ? handle : xtensors[i]->GetXlaData());
    if (!WaitForData(data, deadline)) {
      return Expired("waiting for", Describe(tensors[i], i, tensors.size()), 0,
                     timeout_s);
    }
    XLA_ASSIGN_OR_RETURN(DataPieces dp,
                         PjRtAccess::GetDataPieces(*pjrt_client, data));
    const at::Tensor& t = tensors[i];
    results[i] = at::empty(t.sizes(), t.options().device(at::kCPU));
    auto bytes_of = [](const xla::PjRtBuffer& buffer) {
      return xla::ShapeUtil::ByteSizeOf(
          xla::ShapeUtil::DeviceShapeToHostShape(buffer.on_device_shape()));
    };
    if (!dp.is_sharded) {
      pieces.push_back(
          {i, dp.pieces[0].buffer, {}, {}, bytes_of(*dp.pieces[0].buffer)});
      continue;
    }
    // Each tile from its lowest local replica, placed by the buffers' own
    // dimensions; a tile no local device holds fails the transfer (the
    // result would otherwise keep uninitialised memory there).
    std::vector<LocalShard> shards;
    for (const auto& p : dp.pieces) {
      ::xlakit::RuntimeDevice parsed;
      std::string error = ::xlakit::ParseRuntimeDevice(p.device, &parsed);
      if (!error.empty()) return absl::InternalError(error);
      const xla::Shape& s = p.buffer->on_device_shape();
      shards.push_back(
          {parsed.ordinal,
           std::vector<int64_t>(s.dimensions().begin(), s.dimensions().end())});
    }
    absl::StatusOr<std::vector<ShardRegion>> regions =
        runtime::xlakit::PlanShardAssembly(dp.sharding, t.sizes().vec(),
                                           shards);
    if (!regions.ok()) {
      return absl::Status(regions.status().code(),
                          absl::StrCat("_xla_transfer_to_host: ",
                                       Describe(t, i, tensors.size()), ": ",
                                       regions.status().message()));
    }
    for (ShardRegion& r : *regions) {
      const auto& buffer = dp.pieces[r.shard].buffer;
      pieces.push_back({i, buffer, std::move(r.start), std::move(r.extent),
                        bytes_of(*buffer)});
    }
  }

  std::vector<int64_t> sizes;
  for (const Piece& p : pieces) sizes.push_back(p.bytes);
  std::vector<::xlakit::TransferBatch> batches;
  std::string error =
      ::xlakit::PlanTransferBatches(sizes, max_inflight_bytes, &batches);
  if (!error.empty()) return absl::InvalidArgumentError(error);

  int64_t bytes_done = 0;
  for (const ::xlakit::TransferBatch& batch : batches) {
    std::vector<std::shared_ptr<PendingCopy>> copies;
    for (size_t k = batch.begin; k < batch.end; ++k) {
      auto copy = std::make_shared<PendingCopy>();
      copy->literal = xla::Literal(xla::ShapeUtil::DeviceShapeToHostShape(
          pieces[k].buffer->on_device_shape()));
      pieces[k]
          .buffer->ToLiteral(&copy->literal)
          .OnReady([copy](absl::Status status) {
            copy->status = std::move(status);
            copy->done.Notify();
          });
      copies.push_back(std::move(copy));
    }
    for (size_t k = batch.begin; k < batch.end; ++k) {
      const Piece& piece = pieces[k];
      PendingCopy& copy = *copies[k - batch.begin];
      if (!copy.done.WaitForNotificationWithTimeout(deadline - absl::Now())) {
        return Expired(
            "copying",
            Describe(tensors[piece.tensor], piece.tensor, tensors.size()),
            bytes_done, timeout_s);
      }
      XLA_RETURN_IF_ERROR(copy.status);
      at::Tensor host = MakeTensorFromXlaLiteral(
          copy.literal, results[piece.tensor].scalar_type());
      at::Tensor& out = results[piece.tensor];
      if (piece.start.empty()) {
        out.copy_(host.view(out.sizes()));
      } else {
        // Edge shards carry padding: keep only the region's extent.
        at::Tensor dst = out;
        for (size_t d = 0; d < piece.start.size(); ++d) {
          dst = dst.narrow(d, piece.start[d], piece.extent[d]);
          host = host.narrow(d, 0, piece.extent[d]);
        }
        dst.copy_(host);
      }
      bytes_done += piece.bytes;
    }
  }
  return results;
}

}  // namespace xlakit
}  // namespace torch_xla
