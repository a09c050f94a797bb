// xlakit's PJRT client adapters; see pjrt_access.h. Compiled as part of
// //torch_xla/csrc/runtime:pjrt_computation_client (patch
// Build-xlakit-sources-into-the-runtime-and-_XLAC). The cache-entry logic
// is in cache_entry.cc and the memory sums in memory_stats.cc; this file
// only reaches into the client and turns their results into torch_xla's
// types, counters and logs.
#include "torch_xla/csrc/runtime/xlakit/pjrt_access.h"

#include <memory>
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
#include "torch_xla/csrc/runtime/xlakit/cache_entry.h"
#include "torch_xla/csrc/runtime/xlakit/core/device_string.h"
#include "torch_xla/csrc/runtime/xlakit/core/entry_fate.h"
#include "torch_xla/csrc/runtime/xlakit/core/entry_mac_openssl.h"
#include "torch_xla/csrc/runtime/xlakit/core/envelope.h"
#include "torch_xla/csrc/status.h"

namespace torch_xla {
namespace runtime {
namespace xlakit {
namespace {

::xlakit::RuntimeIdentity Identity(const xla::PjRtClient& client) {
  return IdentityOf(client, PatchSeriesId(), GetBuildInfo().torch_xla_commit);
}

}  // namespace

std::string PjRtAccess::SerializeComputation(
    PjRtComputationClient& client,
    const ComputationClient::ComputationPtr& computation) {
  const auto& pjrt =
      dynamic_cast<const PjRtComputationClient::PjRtComputation&>(*computation);
  // One MAC per entry; none (a plain entry) when the job has no key.
  std::unique_ptr<::xlakit::EntryMac> mac = ::xlakit::NewEntryMacFromEnv();
  absl::StatusOr<std::string> entry = EncodeExecutableEntry(
      *pjrt.executable, Identity(*client.client_), mac.get());
  if (!entry.ok()) {
    // Empty means "do not write" to the cache hook; the process goes on and
    // the next run compiles again.
    TF_LOG(WARNING) << "xlakit: executable not cached: " << entry.status();
    return "";
  }
  return *std::move(entry);
}

ComputationClient::ComputationPtr PjRtAccess::DeserializeComputation(
    PjRtComputationClient& client, const std::string& serialized) {
  std::unique_ptr<::xlakit::EntryMac> mac = ::xlakit::NewEntryMacFromEnv();
  LoadedEntry loaded = LoadExecutableEntry(
      *client.client_, serialized, Identity(*client.client_), mac.get());
  if (loaded.executable == nullptr) {
    // Counted (torch_xla.debug.metrics) and logged with the reason, so a
    // restart that recompiled says why; the cache erases or keeps the file.
    TF_LOG(WARNING) << "xlakit: persistent cache entry rejected ("
                    << loaded.reason << "): " << loaded.detail
                    << "; recompiling, entry "
                    << (loaded.fate == ::xlakit::EntryFate::kKeep ? "kept"
                                                                  : "erased");
    XLA_COUNTER("XlakitCacheReject", 1);
    ::xlakit::NoteEntryFate(loaded.fate);
    return nullptr;
  }
  std::string device =
      UseVirtualDevice() ? client.spmd_device_str : client.GetDefaultDevice();
  xla::XlaComputation computation(std::move(loaded.module));
  return std::make_shared<PjRtComputationClient::PjRtComputation>(
      std::move(computation), std::vector<std::string>{device},
      std::move(loaded.executable));
}

torch::lazy::hash_t PjRtAccess::SaltCompilationEnvHash(
    xla::PjRtClient* client, torch::lazy::hash_t hash) {
  // Upstream returns early with the topology hash, which on some plugins
  // omits the platform version; salting after the fact covers both paths.
  // The key's id keeps jobs with different keys (or none) from meeting, and
  // erasing, each other's entries in a folder they share.
  std::string material = ::xlakit::CacheKeyMaterial(
      Identity(*client), ::xlakit::JobKeyId(::xlakit::NewEntryMacFromEnv()));
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
  std::vector<tsl::AllocatorStats> per_device;
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
    per_device.push_back(*std::move(stats));
  }
  return SumAllocatorStats(per_device);
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
