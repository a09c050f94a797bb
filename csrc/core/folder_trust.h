// Who can put an entry into a persistent cache folder, judged before any
// entry is trusted. The one implementation of the rule: xlakit._C binds it for
// `xlakit.enable_persistent_cache` and the cache tools (python/xlakit/
// cache_trust.py), and the PJRT wrapping plugin (csrc/pjrt_wrap) judges its
// folder with it in jobs that run no xlakit Python at all.
//
// A cache entry is code the job runs. Whoever can write the cache folder, or
// replace it by writing any folder above it, can make every later job run
// theirs; an envelope's checksum proves an entry intact, not who wrote it. The
// rule is ssh's StrictModes, applied from the cache folder up to `/`: every
// folder is owned by root or by the user, and no other user can write it. A
// folder above the cache may be writable by others only when it is sticky
// (`/tmp`): nobody else can then rename or remove what the user owns in it.
// The cache folder itself never may: a sticky bit stops removals, not new
// entries. Each entry is judged too: an entry another user owns, or others
// can write, can be rewritten in place with their code, whoever owns the
// folder (a file writable by the owner's private group, as a stock runtime
// writes under umask 002, counts as the owner's). The PJRT wrapper judges an
// entry when it reads it (JudgeCacheEntry, on the open descriptor; links are
// never followed), so a start costs no stat per entry and one bad file is a
// refused entry, not a cache turned off; where another runtime reads the
// entries, the folder judgement stats every file (a link by what it leads to). `trust_shared` (a team cache on purpose)
// accepts a folder writable
// by a group the user belongs to, or owned by a member of it; writable by
// every user stays refused. POSIX only; no XLA, torch or Python headers.
#ifndef XLAKIT_CORE_FOLDER_TRUST_H_
#define XLAKIT_CORE_FOLDER_TRUST_H_

#include <sys/stat.h>

#include <string>
#include <vector>

namespace xlakit {

inline constexpr char kOwnerOnly[] = "owner-only";
inline constexpr char kSharedTrusted[] = "shared-trusted";
inline constexpr char kUntrusted[] = "untrusted";

struct FolderTrust {
  // The folder judged, with links and `..` resolved.
  std::string folder;
  // kOwnerOnly, kSharedTrusted or kUntrusted.
  std::string state;
  // When untrusted: the folder at fault with its owner, group and mode, and
  // why that lets others put code into the job; and the command that fixes it.
  std::string problem;
  std::string fix;
  // What only trust_shared made acceptable.
  std::vector<std::string> shared;
  // Untrusted because the path is, or lies below, something other than a
  // folder (a character device such as /dev/null, a regular file): `problem`
  // says what it is, and no chmod is advised on it.
  bool not_a_folder = false;

  bool trusted() const { return state != kUntrusted; }
};

// The verdict on `folder`, which need not exist: the folders xlakit would
// create are owner-only, so the nearest existing one is judged as a folder
// above the cache. A path that is not a folder, or lies below one that is
// not, is refused for that first (`not_a_folder`). `judge_entries`: the
// files already in the folder are judged too (one stat each). The PJRT
// wrapper passes false, since it judges each entry as it reads it
// (JudgeCacheEntry); a runtime that reads entries itself (torch_xla's own
// cache, TorchTPU's) and the cache tools judge them here. Never throws.
FolderTrust JudgeCacheFolder(const std::string& folder, bool trust_shared,
                             bool judge_entries = true);

struct EntryTrust {
  bool trusted = true;
  // When not: the file with its owner and mode, why that lets others put
  // code into the job, and the command that fixes it.
  std::string problem;
  std::string fix;
};

// The rule for one entry of a judged folder, applied where it is read: `st`
// from fstat() of the descriptor the entry is then read from (no second
// open, so nothing can swap the file between the check and the read). The
// same rule the folder judgement applies to each file. Never throws.
EntryTrust JudgeCacheEntry(const std::string& path, const struct stat& st,
                           bool trust_shared);

// `folder` with symbolic links and `.`/`..` resolved, as far as it exists;
// the missing rest appended (Python's Path.resolve()).
std::string ResolvePath(const std::string& folder);

}  // namespace xlakit

#endif  // XLAKIT_CORE_FOLDER_TRUST_H_
