// xlakit's persistent-cache entries against a PJRT client: an executable
// serialized into the envelope (core/envelope.h), an entry loaded back
// (LoadSerializedExecutable, else DeserializeExecutable + Load), and the fate
// of an entry that was not used (core/entry_fate.h). Needs XLA headers only,
// no torch_xla: `make cxx-check` compiles it and runs it against a real PJRT
// CPU client; pjrt_access.cc is the thin torch_xla caller.
//
// Only executables are cached. A client that cannot serialize them gets no
// entry (a recompile next time) rather than an HLO module: the module a
// compiled computation keeps is the optimized one, already partitioned under
// SPMD, and compiling it again would partition it twice.
#ifndef XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_CACHE_ENTRY_H_
#define XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_CACHE_ENTRY_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "xla/pjrt/pjrt_client.h"
#include "xla/service/hlo.pb.h"

#include "torch_xla/csrc/runtime/xlakit/core/entry_fate.h"
#include "torch_xla/csrc/runtime/xlakit/core/envelope.h"

namespace torch_xla {
namespace runtime {
namespace xlakit {

// The identity entries are written with and checked against: the client's
// platform name and version, plus what the build stamped.
::xlakit::RuntimeIdentity IdentityOf(const xla::PjRtClient& client,
                                     std::string patch_series_id,
                                     std::string torch_xla_revision);

// The executable in an envelope, tagged under `mac` when the job has a key
// (XLAKIT_CACHE_KEY; nullptr: a plain entry). UNIMPLEMENTED where the client
// cannot serialize executables, FAILED_PRECONDITION for a refused key
// (RefusedEntryMac), INTERNAL when the MAC fails; other errors as
// SerializeExecutable returns them.
absl::StatusOr<std::string> EncodeExecutableEntry(
    const xla::PjRtLoadedExecutable& executable,
    const ::xlakit::RuntimeIdentity& self, ::xlakit::EntryMac* mac);

struct LoadedEntry {
  // Set when the entry was used; then `module` is its one HLO module.
  std::unique_ptr<xla::PjRtLoadedExecutable> executable;
  xla::HloModuleProto module;
  // When not used: a short reason (an envelope status name, "load_failed",
  // ...), what was found, and what the cache should do with the file.
  std::string reason;
  std::string detail;
  ::xlakit::EntryFate fate = ::xlakit::EntryFate::kErase;
};

// Never throws or aborts: every refusal comes back as a LoadedEntry without
// an executable. With `mac` (the job has a key) an entry without a tag that
// verifies under it is refused (unauthenticated, bad_tag) before the client
// sees a byte of it: a cache entry is code the job runs. A refused key
// (key_refused) loads nothing and keeps the entry.
LoadedEntry LoadExecutableEntry(xla::PjRtClient& client, std::string_view entry,
                                const ::xlakit::RuntimeIdentity& self,
                                ::xlakit::EntryMac* mac);

// kKeep for failures that say "not now" (RESOURCE_EXHAUSTED, e.g. device
// memory while loading; UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED, CANCELLED),
// kErase for the rest: an entry this runtime refuses once it refuses for
// good, and keeping it would block a good entry from being written.
::xlakit::EntryFate FateOfLoadFailure(const absl::Status& status);

}  // namespace xlakit
}  // namespace runtime
}  // namespace torch_xla

#endif  // XLA_TORCH_XLA_CSRC_RUNTIME_XLAKIT_CACHE_ENTRY_H_
