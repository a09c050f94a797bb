// Atomic file replacement for cache entries: write a temporary file in the
// target's directory, fsync it, rename it over the target, fsync the
// directory. Readers see the old entry or the new one, never a torn one, and
// a killed writer leaves only a temporary file that `xlakit cache prune`
// removes. POSIX only; no XLA or torch headers.
#ifndef XLAKIT_CORE_ATOMIC_FILE_H_
#define XLAKIT_CORE_ATOMIC_FILE_H_

#include <string>
#include <string_view>

namespace xlakit {

// Temporary files start with this prefix so tools can tell them apart.
inline constexpr char kTempPrefix[] = ".xlakit-tmp.";

// Returns "" on success, else a message with the path and errno text. On
// failure the temporary file is removed and the target is untouched.
std::string WriteFileAtomic(const std::string& path, std::string_view data);

}  // namespace xlakit

#endif  // XLAKIT_CORE_ATOMIC_FILE_H_
