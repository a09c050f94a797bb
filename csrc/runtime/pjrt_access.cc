// xlakit's PJRT client adapters; see pjrt_access.h. Compiled as part of
// //torch_xla/csrc/runtime:pjrt_computation_client (patch
// Build-xlakit-sources-into-the-runtime-and-_XLAC).
//
// PJRT calls, checked against openxla xla/pjrt/pjrt_client.h (see the patch
// bodies for the commits):
//   PjRtExecutable::SerializeExecutable() -> absl::StatusOr<std::string>
//   PjRtClient::LoadSerializedExecutable(absl::string_view,
//       std::optional<CompileOptions>, const LoadOptions&)
//       -> absl::StatusOr<std::unique_ptr<PjRtLoadedExecutable>>
//   PjRtClient::DeserializeExecutable(absl::string_view,
//       std::optional<CompileOptions>)
//       -> absl::StatusOr<std::unique_ptr<PjRtExecutable>>
//   PjRtClient::Load(std::shared_ptr<PjRtExecutable>, const LoadOptions&)
//   PjRtDevice::GetAllocatorStats() -> absl::StatusOr<tsl::AllocatorStats>
//       (bytes_limit is std::optional<int64_t>; UNIMPLEMENTED on CPU)
#include "torch_xla/csrc/runtime/xlakit/pjrt_access.h"

#include <exception>
#include <string_view>
#include <utility>

#include <torch/csrc/lazy/core/hash.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "xla/hlo/builder/xla_computation.h"

#include "torch_xla/csrc/device.h"
#include "torch_xla/csrc/runtime/debug_macros.h"
#include "torch_xla/csrc/runtime/metrics.h"
#include "torch_xla/csrc/runtime/pjrt_computation_client.h"
#include "torch_xla/csrc/runtime/tf_logging.h"
#include "torch_xla/csrc/runtime/xlakit/build_info.h"
#include "torch_xla/csrc/runtime/xlakit/core/device_string.h"
#include "torch_xla/csrc/runtime/xlakit/core/envelope.h"
#include "torch_xla/csrc/status.h"

namespace torch_xla {
namespace runtime {
namespace xlakit {
namespace {

::xlakit::RuntimeIdentity Identity(xla::PjRtClient* client) {
  return {std::string(client->platform_name()),
          std::string(client->platform_version()), PatchSeriesId()};
}

// Rejections are counted (torch_xla.debug.metrics) and logged with the
// reason, so a restart that recompiled says why.
ComputationClient::ComputationPtr Reject(std::string_view reason,
                                         std::string_view detail) {
  TF_LOG(WARNING) << "xlakit: persistent cache entry rejected (" << reason
                  << "): " << detail << "; recompiling";
  XLA_COUNTER("XlakitCacheReject", 1);
  return nullptr;
}

}  // namespace

std::string PjRtAccess::SerializeComputation(
    PjRtComputationClient& client,
    const ComputationClient::ComputationPtr& computation) {
  const auto& pjrt =
      dynamic_cast<const PjRtComputationClient::PjRtComputation&>(*computation);
  ::xlakit::RuntimeIdentity self = Identity(client.client_.get());
  ::xlakit::EntryHeader header;
  header.platform_name = self.platform_name;
  header.platform_version = self.platform_version;
  header.patch_series_id = self.patch_series_id;
  header.torch_xla_revision = GetBuildInfo().torch_xla_commit;
  absl::StatusOr<std::string> blob = pjrt.executable->SerializeExecutable();
  if (blob.ok()) {
    header.kind = ::xlakit::EntryKind::kExecutable;
    return ::xlakit::EncodeEntry(header, *blob);
  }
  if (!absl::IsUnimplemented(blob.status())) {
    // Empty means "do not write" to the cache hook; the process goes on.
    TF_LOG(WARNING) << "xlakit: cannot serialize executable: " << blob.status();
    return "";
  }
  header.kind = ::xlakit::EntryKind::kHloModule;
  return ::xlakit::EncodeEntry(
      header, computation->computation().proto().SerializeAsString());
}

ComputationClient::ComputationPtr PjRtAccess::DeserializeComputation(
    PjRtComputationClient& client, const std::string& serialized) {
  xla::PjRtClient* pjrt_client = client.client_.get();
  ::xlakit::DecodeResult entry =
      ::xlakit::VerifyEntry(serialized, Identity(pjrt_client));
  if (entry.status != ::xlakit::EntryStatus::kOk) {
    return Reject(::xlakit::EntryStatusName(entry.status), entry.message);
  }
  std::string_view payload =
      std::string_view(serialized).substr(entry.header.payload_offset);
  std::string device =
      UseVirtualDevice() ? client.spmd_device_str : client.GetDefaultDevice();

  if (entry.header.kind == ::xlakit::EntryKind::kHloModule) {
    xla::HloModuleProto proto;
    if (!proto.ParseFromArray(payload.data(),
                              static_cast<int>(payload.size()))) {
      return Reject("bad_hlo", "payload is not an HloModuleProto");
    }
    xla::XlaComputation computation(std::move(proto));
    absl::StatusOr<xla::ProgramShape> program_shape =
        computation.GetProgramShape();
    if (!program_shape.ok()) {
      return Reject("bad_hlo", program_shape.status().ToString());
    }
    const xla::Shape& result = program_shape->result();
    std::vector<ComputationClient::CompileInstance> instances;
    instances.emplace_back(std::move(computation), device,
                           client.GetCompilationDevices(device, {}), &result,
                           /*parameter_is_tupled_arguments=*/false,
                           /*is_sharded=*/UseVirtualDevice());
    // Compile reports errors by throwing; a cache entry must not take the
    // process down, so a failure here is one more counted miss.
    try {
      return client.Compile(std::move(instances)).front();
    } catch (const std::exception& e) {
      return Reject("compile_failed", e.what());
    }
  }

  // LoadSerializedExecutable is what the PJRT C API client (TPU plugins) and
  // the CPU client implement; DeserializeExecutable + Load is the older path
  // some clients still only have.
  absl::StatusOr<std::unique_ptr<xla::PjRtLoadedExecutable>> loaded =
      pjrt_client->LoadSerializedExecutable(payload, std::nullopt,
                                            xla::LoadOptions());
  if (absl::IsUnimplemented(loaded.status())) {
    absl::StatusOr<std::unique_ptr<xla::PjRtExecutable>> executable =
        pjrt_client->DeserializeExecutable(payload, std::nullopt);
    if (!executable.ok()) {
      return Reject("deserialize_failed", executable.status().ToString());
    }
    loaded = pjrt_client->Load(std::move(*executable), xla::LoadOptions());
  }
  if (!loaded.ok()) return Reject("load_failed", loaded.status().ToString());

  auto modules = (*loaded)->GetHloModules();
  if (!modules.ok())
    return Reject("no_hlo_module", modules.status().ToString());
  if (modules->size() != 1) {
    // Upstream aborts the process here; a cache entry must never do that.
    return Reject("multiple_hlo_modules",
                  absl::StrCat(modules->size(), " modules, expected 1"));
  }
  xla::XlaComputation computation((*modules)[0]->ToProto());
  return std::make_shared<PjRtComputationClient::PjRtComputation>(
      std::move(computation), std::vector<std::string>{device},
      std::move(*loaded));
}

torch::lazy::hash_t PjRtAccess::SaltCompilationEnvHash(
    xla::PjRtClient* client, torch::lazy::hash_t hash) {
  // Upstream returns early with the topology hash, which on some plugins
  // omits the platform version; salting after the fact covers both paths.
  std::string material = ::xlakit::CacheKeyMaterial(Identity(client));
  return torch::lazy::HashCombine(
      hash, torch::lazy::DataHash(material.data(), material.size()));
}

absl::StatusOr<RuntimeMemoryInfo> PjRtAccess::GetRuntimeMemoryInfo(
    PjRtComputationClient& client, const std::string& device) {
  std::vector<std::string> known = client.GetLocalDevices();
  ::xlakit::RuntimeDevice parsed;
  std::string error = ::xlakit::ValidateRuntimeDevice(
      device, known, /*allow_virtual=*/true, &parsed);
  if (!error.empty()) return absl::InvalidArgumentError(error);
  std::vector<std::string> targets =
      parsed.is_virtual ? known : std::vector<std::string>{device};
  RuntimeMemoryInfo total;
  total.bytes_limit = 0;
  total.peak_bytes_used = 0;
  for (const std::string& target : targets) {
    xla::PjRtDevice* pjrt_device = client.StringToPjRtDevice(target);
    absl::StatusOr<tsl::AllocatorStats> stats =
        pjrt_device->GetAllocatorStats();
    if (!stats.ok()) {
      return absl::UnimplementedError(
          absl::StrCat("platform ", client.client_->platform_name(),
                       " keeps no allocator stats for ", target, " (",
                       stats.status().message(), ")"));
    }
    total.bytes_used += stats->bytes_in_use;
    *total.peak_bytes_used += stats->peak_bytes_in_use;
    // One device without a known limit makes the sum unknown.
    if (stats->bytes_limit.has_value() && total.bytes_limit.has_value()) {
      *total.bytes_limit += *stats->bytes_limit;
    } else {
      total.bytes_limit.reset();
    }
  }
  return total;
}

absl::StatusOr<DataPieces> PjRtAccess::GetDataPieces(
    PjRtComputationClient& client, const ComputationClient::DataPtr& handle) {
  DataPieces out;
  auto add = [&](const std::shared_ptr<PjRtComputationClient::PjRtData>& d)
      -> absl::Status {
    if (d == nullptr || d->buffer == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("device data ", handle->ToString(),
                       " has no buffer yet (still being computed)"));
    }
    out.pieces.push_back({d->buffer, d->device()});
    return absl::OkStatus();
  };
  if (auto data =
          std::dynamic_pointer_cast<PjRtComputationClient::PjRtData>(handle)) {
    XLA_RETURN_IF_ERROR(add(data));
    return out;
  }
  auto sharded =
      std::dynamic_pointer_cast<PjRtComputationClient::PjRtShardedData>(handle);
  if (sharded == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected PjRtData or PjRtShardedData, got ", handle->ToString()));
  }
  out.is_sharded = true;
  out.sharding = sharded->GetSharding();
  for (const auto& shard : sharded->shards) XLA_RETURN_IF_ERROR(add(shard));
  return out;
}

}  // namespace xlakit
}  // namespace runtime
}  // namespace torch_xla
