// Cache entry files: atomic replacement (write a temporary file in the
// target's directory, fsync it, rename it over the target, fsync the
// directory; readers see the old entry or the new one, never a torn one, and a
// killed writer leaves only a temporary file that `xlakit cache prune`
// removes), and reading and removing an entry with every failure reported as
// a message, never thrown. POSIX only; no XLA or torch headers.
#ifndef XLAKIT_CORE_ATOMIC_FILE_H_
#define XLAKIT_CORE_ATOMIC_FILE_H_

#include <string>
#include <string_view>

namespace xlakit {

// Temporary files start with this prefix so tools can tell them apart.
inline constexpr char kTempPrefix[] = ".xlakit-tmp.";

// The temporary file a write to `path` goes through, beside it:
// <dir>/<kTempPrefix><base>.<host>.<pid>.<counter>.<16 random hex digits>.
// Host and random bits keep writers apart where pid + counter does not:
// hosts sharing an NFS cache, containers that all run as PID 1.
std::string TempPathFor(const std::string& path);

// The name of the file a temporary that TempPathFor made is to become, from
// the temporary's file name (no folder); "" for any other name. The target's
// name is read up to its first dot, exact for torch_xla's cache entries
// (decimal hashes). Tools (`xlakit cache prune`) recognise the writer's
// temporaries with this, so the name's format lives here only.
std::string TempFileTarget(std::string_view name);

// Returns "" on success, else a message with the path and errno text. On
// failure the temporary file is removed and the target is untouched. An entry
// is code the jobs run, so it gets mode 0600, or 0640 when the folder lets its
// group read and search it (a cache shared with trust_shared), whatever the
// umask; the temporary is created O_EXCL | O_NOFOLLOW.
std::string WriteFileAtomic(const std::string& path, std::string_view data);

// Reads the whole file at `path` into `*data`. Returns "" on success (a file
// that ends early gives what it holds: the entry's own checks find that),
// else a message with the path and errno text: the read failed, which says
// nothing about the entry. Never follows a link.
std::string ReadWholeFile(const std::string& path, std::string* data);

// Removes the file at `path`; "" on success or when it is already gone, else
// a message with the path and errno text (a folder the job may not change, a
// read-only file system).
std::string RemoveFile(const std::string& path);

}  // namespace xlakit

#endif  // XLAKIT_CORE_ATOMIC_FILE_H_
