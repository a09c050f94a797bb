// Persistent-cache entries against a PJRT client; see cache_entry.h.
//
// PJRT calls, compiled against the XLA headers that bracket the pinned
// openxla (`make cxx-check`) and run against a real CPU client there:
//   PjRtLoadedExecutable::SerializeExecutable() -> StatusOr<std::string>
//   PjRtClient::LoadSerializedExecutable(absl::string_view,
//       std::optional<CompileOptions>, const LoadOptions&)
//       -> StatusOr<std::unique_ptr<PjRtLoadedExecutable>>
//   PjRtClient::DeserializeExecutable(absl::string_view,
//       std::optional<CompileOptions>)
//       -> StatusOr<std::unique_ptr<PjRtExecutable>>
//   PjRtClient::Load(std::unique_ptr<PjRtExecutable>, const LoadOptions&)
#include "torch_xla/csrc/runtime/xlakit/cache_entry.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"

namespace torch_xla {
namespace runtime {
namespace xlakit {
namespace {

LoadedEntry Refuse(std::string reason, std::string detail,
                   ::xlakit::EntryFate fate) {
  LoadedEntry out;
  out.reason = std::move(reason);
  out.detail = std::move(detail);
  out.fate = fate;
  return out;
}

LoadedEntry RefuseLoad(const char* reason, const absl::Status& status) {
  return Refuse(reason, status.ToString(), FateOfLoadFailure(status));
}

}  // namespace

::xlakit::RuntimeIdentity IdentityOf(const xla::PjRtClient& client,
                                     std::string patch_series_id,
                                     std::string torch_xla_revision) {
  return {std::string(client.platform_name()),
          std::string(client.platform_version()), std::move(patch_series_id),
          std::move(torch_xla_revision)};
}

absl::StatusOr<std::string> EncodeExecutableEntry(
    const xla::PjRtLoadedExecutable& executable,
    const ::xlakit::RuntimeIdentity& self, ::xlakit::EntryMac* mac) {
  if (mac != nullptr && !mac->Refusal().empty()) {
    return absl::FailedPreconditionError(mac->Refusal());
  }
  absl::StatusOr<std::string> blob = executable.SerializeExecutable();
  if (!blob.ok()) return blob.status();
  ::xlakit::EntryHeader header;
  header.kind = ::xlakit::EntryKind::kExecutable;
  header.platform_name = self.platform_name;
  header.platform_version = self.platform_version;
  header.patch_series_id = self.patch_series_id;
  header.torch_xla_revision = self.torch_xla_revision;
  if (mac == nullptr) return ::xlakit::EncodeEntry(header, *blob);
  std::string entry = ::xlakit::EncodeAuthenticatedEntry(header, *blob, *mac);
  if (entry.empty()) {
    return absl::InternalError(
        "the crypto library failed to compute the entry's HMAC-SHA256 tag");
  }
  return entry;
}

::xlakit::EntryFate FateOfLoadFailure(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kCancelled:
      return ::xlakit::EntryFate::kKeep;
    default:
      return ::xlakit::EntryFate::kErase;
  }
}

LoadedEntry LoadExecutableEntry(xla::PjRtClient& client, std::string_view entry,
                                const ::xlakit::RuntimeIdentity& self,
                                ::xlakit::EntryMac* mac) {
  // The tag first, when the job has a key; then the envelope and identity.
  // `payload_offset` is relative to `entry`, tag prefix included.
  ::xlakit::DecodeResult decoded =
      ::xlakit::VerifyCacheEntry(entry, &self, mac);
  if (decoded.status == ::xlakit::EntryStatus::kKeyRefused) {
    // This job's key is unusable: the entry may be good for every other job.
    return Refuse(::xlakit::EntryStatusName(decoded.status), decoded.message,
                  ::xlakit::EntryFate::kKeep);
  }
  if (decoded.status != ::xlakit::EntryStatus::kOk) {
    // Untagged or badly tagged under the job's key, corrupt, truncated,
    // foreign or another runtime's: never loadable here.
    return Refuse(::xlakit::EntryStatusName(decoded.status), decoded.message,
                  ::xlakit::EntryFate::kErase);
  }
  if (decoded.header.kind != ::xlakit::EntryKind::kExecutable) {
    return Refuse("unsupported_kind",
                  absl::StrCat("entry holds a ",
                               ::xlakit::EntryKindName(decoded.header.kind),
                               "; only executables are loaded"),
                  ::xlakit::EntryFate::kErase);
  }
  absl::string_view payload(entry.data() + decoded.header.payload_offset,
                            decoded.header.payload_length);
  // LoadSerializedExecutable is what the PJRT C API client (TPU plugins) and
  // the CPU client implement; DeserializeExecutable + Load is the older path
  // some clients only have.
  absl::StatusOr<std::unique_ptr<xla::PjRtLoadedExecutable>> loaded =
      client.LoadSerializedExecutable(payload, std::nullopt,
                                      xla::LoadOptions());
  if (absl::IsUnimplemented(loaded.status())) {
    absl::StatusOr<std::unique_ptr<xla::PjRtExecutable>> executable =
        client.DeserializeExecutable(payload, std::nullopt);
    if (!executable.ok()) {
      return RefuseLoad("deserialize_failed", executable.status());
    }
    loaded = client.Load(*std::move(executable), xla::LoadOptions());
  }
  if (!loaded.ok()) return RefuseLoad("load_failed", loaded.status());

  auto modules = (*loaded)->GetHloModules();
  if (!modules.ok()) return RefuseLoad("no_hlo_module", modules.status());
  if (modules->size() != 1) {
    return Refuse("multiple_hlo_modules",
                  absl::StrCat(modules->size(), " modules, expected 1"),
                  ::xlakit::EntryFate::kErase);
  }
  LoadedEntry out;
  out.module = (*modules)[0]->ToProto();
  out.executable = *std::move(loaded);
  out.fate = ::xlakit::EntryFate::kKeep;
  return out;
}

}  // namespace xlakit
}  // namespace runtime
}  // namespace torch_xla
