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
#include "torch_xla/csrc/runtime/pjrt_computation_client.h"
#include "torch_xla/csrc/runtime/runtime.h"
#include "torch_xla/csrc/runtime/xlakit/core/batch_plan.h"
#include "torch_xla/csrc/runtime/xlakit/pjrt_access.h"
#include "torch_xla/csrc/tensor_util.h"
#include "torch_xla/csrc/unwrap_data.h"
#include "torch_xla/csrc/xla_graph_executor.h"
#include "torch_xla/csrc/xla_sharding_util.h"

namespace torch_xla {
namespace xlakit {
namespace {

using runtime::xlakit::DataPieces;
using runtime::xlakit::PjRtAccess;

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
  std::vector<at::indexing::TensorIndex> index;  // empty: the whole tensor
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
  // One sync for all of them: pending IR becomes one graph, not one each.
  XLAGraphExecutor::Get()->SyncTensorsGraph(&xtensors, {}, /*wait=*/false,
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
    runtime::ComputationClient::DataPtr data =
        UnwrapXlaData(xtensors[i]->GetXlaData());
    if (!WaitForData(data, deadline)) {
      return Expired("waiting for", Describe(tensors[i], i, tensors.size()), 0,
                     timeout_s);
    }
    XLA_ASSIGN_OR_RETURN(DataPieces dp,
                         PjRtAccess::GetDataPieces(*pjrt_client, data));
    const at::Tensor& t = tensors[i];
    results[i] = at::empty(t.sizes(), t.options().device(at::kCPU));
    std::vector<std::pair<int, std::vector<at::indexing::TensorIndex>>>
        replica_and_index;
    if (dp.is_sharded && dp.sharding.type() != xla::OpSharding::REPLICATED &&
        dp.sharding.type() != xla::OpSharding::OTHER) {
      // The shard index math upstream supports covers these two only.
      return absl::UnimplementedError(absl::StrCat(
          "_xla_transfer_to_host: ", Describe(t, i, tensors.size()),
          " has sharding type ", xla::OpSharding::Type_Name(dp.sharding.type()),
          "; only REPLICATED and OTHER (tiled) shardings are supported"));
    }
    if (dp.is_sharded && dp.sharding.type() == xla::OpSharding::OTHER) {
      // As _get_local_shard_replica_and_indices computes it upstream: the
      // shard shape from the tensor's sharding spec, devices from the shards.
      XLATensor::ShardingSpecPtr spec = xtensors[i]->sharding_spec();
      std::vector<int64_t> shard_shape;
      if (spec != nullptr) {
        shard_shape = ShardingUtil::GetShardShape(spec);
      } else {
        const xla::Shape& s = dp.pieces[0].buffer->on_device_shape();
        shard_shape.assign(s.dimensions().begin(), s.dimensions().end());
      }
      std::vector<std::string> devices;
      for (const auto& p : dp.pieces) devices.push_back(p.device);
      replica_and_index = ShardingUtil::GetShardReplicaAndIndicesForDevices(
          shard_shape, t.sizes().vec(), dp.sharding, devices);
    }
    for (size_t s = 0; s < dp.pieces.size(); ++s) {
      // Replicated data, or a replica of a shard already taken: copy once.
      if (replica_and_index.empty() ? s > 0 : replica_and_index[s].first != 0)
        continue;
      Piece piece{i, dp.pieces[s].buffer, {}, 0};
      if (!replica_and_index.empty()) {
        piece.index = replica_and_index[s].second;
      }
      piece.bytes =
          xla::ShapeUtil::ByteSizeOf(xla::ShapeUtil::DeviceShapeToHostShape(
              piece.buffer->on_device_shape()));
      pieces.push_back(std::move(piece));
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
      if (piece.index.empty()) {
        out.copy_(host.view(out.sizes()));
      } else {
        // Edge shards carry padding: keep only what the index covers.
        at::Tensor dst = out.index(piece.index);
        for (int64_t d = 0; d < dst.dim(); ++d) {
          host = host.narrow(d, 0, dst.size(d));
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
