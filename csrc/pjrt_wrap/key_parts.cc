// The environment's part of a cache key; see key_parts.h.
#include "pjrt_wrap/key_parts.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

#include "pjrt_wrap/env.h"

namespace xlakit {
namespace pjrt_wrap {
namespace {

// Flags that change what a plugin writes to its logs and dump folders, never
// the executable.
bool DebugOnly(const std::string& name) {
  static const char* const kExact[] = {
      "v",           "vmodule",         "log_dir",        "logtostderr",
      "alsologtostderr", "stderrthreshold", "minloglevel"};
  for (const char* exact : kExact) {
    if (name == exact) return true;
  }
  return name.rfind("xla_dump_", 0) == 0;
}

// A flag's name as the sort orders it: no dashes, no value, no "no" prefix
// (so `--x` and `--nox`, two settings of one flag, keep their order).
std::string SortName(const std::string& flag) {
  size_t start = flag.find_first_not_of('-');
  std::string name = flag.substr(start == std::string::npos ? flag.size() : start);
  name = name.substr(0, name.find('='));
  return name.rfind("no", 0) == 0 ? name.substr(2) : name;
}

// Whether `word` names a flag file: `--flagfile=PATH` or `-flagfile=PATH`
// (absl's and XLA's spellings; kHere, PATH in *path), or `--flagfile` or
// `-flagfile` alone (absl takes the next word as PATH: kNext).
enum class FlagFile { kNone, kHere, kNext };

FlagFile FlagFileArgument(const std::string& word, std::string* path) {
  for (const char* prefix : {"--flagfile", "-flagfile"}) {
    const size_t n = std::strlen(prefix);
    if (word.compare(0, n, prefix) != 0) continue;
    if (word.size() == n) return FlagFile::kNext;
    if (word[n] == '=') {
      *path = word.substr(n + 1);
      return FlagFile::kHere;
    }
  }
  return FlagFile::kNone;
}

std::string ReadFlagFile(const std::string& path, bool* absent,
                         std::string* problem) {
  // O_NONBLOCK: a FIFO must not block the start; only a regular file is read.
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == ENOENT || errno == ENOTDIR) {
      *absent = true;  // the plugin refuses it; the key says it was absent
    } else {
      *problem = "cannot read flag file " + path + ": " + std::strerror(errno);
    }
    return "";
  }
  struct stat st;
  std::string contents;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    *problem = "flag file " + path +
               " is not a regular file (a FIFO or a device?): the flags in it "
               "cannot be keyed by their contents";
  } else {
    char buf[1 << 16];
    while (contents.size() <= kMaxFlagFileBytes) {
      ssize_t n = read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) *problem = "cannot read flag file " + path + ": " + std::strerror(errno);
      if (n <= 0) break;
      contents.append(buf, static_cast<size_t>(n));
    }
    if (contents.size() > kMaxFlagFileBytes) {
      *problem = "flag file " + path + " holds more than " +
                 std::to_string(kMaxFlagFileBytes) +
                 " bytes: not a flag file this wrapper keys";
    }
  }
  close(fd);
  return problem->empty() ? contents : "";
}

std::string FlagFileDigest(const Libcrypto& crypto, const std::string& path,
                           int depth, std::string* problem);

// The digest of a flag file argument: the file as named and, for absl's
// comma-separated lists, each file of the list (whichever the plugin reads,
// its contents are keyed).
std::string FlagFileArgumentDigest(const Libcrypto& crypto,
                                   const std::string& argument, int depth,
                                   std::string* problem) {
  if (argument.find(',') == std::string::npos) {
    return FlagFileDigest(crypto, argument, depth, problem);
  }
  Sha256 sha(crypto);
  sha.Update("whole " + FlagFileDigest(crypto, argument, depth, problem));
  std::istringstream parts(argument);
  for (std::string part; std::getline(parts, part, ',');) {
    sha.Update("\npart " + FlagFileDigest(crypto, part, depth, problem));
  }
  return problem->empty() ? "sha256:" + sha.Hex() : "";
}

// The SHA-256 of a flag file's contents and, recursively, of the flag files
// they name, so that changing any of them changes the key; "absent" for a
// file that does not exist; "" with *problem set for one that cannot be
// keyed (not a regular file, larger than kMaxFlagFileBytes, unreadable, or
// nested deeper than kMaxFlagFileDepth: a cycle).
std::string FlagFileDigest(const Libcrypto& crypto, const std::string& path,
                           int depth, std::string* problem) {
  if (depth > kMaxFlagFileDepth) {
    *problem = "flag files nest deeper than " +
               std::to_string(kMaxFlagFileDepth) + " at " + path +
               " (do they name each other?)";
    return "";
  }
  bool absent = false;
  const std::string contents = ReadFlagFile(path, &absent, problem);
  if (absent) return "absent";
  if (!problem->empty()) return "";
  Sha256 sha(crypto);
  sha.Update(contents);
  std::istringstream words(contents);
  bool file_next = false;
  for (std::string word, argument; words >> word;) {
    FlagFile kind = file_next ? FlagFile::kHere : FlagFileArgument(word, &argument);
    if (file_next) argument = word;
    file_next = kind == FlagFile::kNext;
    if (kind != FlagFile::kHere) continue;
    sha.Update("\nnested " + argument + " " +
               FlagFileArgumentDigest(crypto, argument, depth + 1, problem));
    if (!problem->empty()) return "";
  }
  return "sha256:" + sha.Hex();
}

}  // namespace

std::string NormalizedFlags(const Libcrypto& crypto, const std::string& value,
                            bool absl_style, std::string* problem) {
  std::vector<std::string> flags;
  std::istringstream words(value);
  bool plain = value.find_first_of("'\"\\") == std::string::npos;
  bool file_next = false;  // `--flagfile PATH`: this word is the path
  for (std::string word, argument; words >> word;) {
    const FlagFile kind = file_next ? FlagFile::kNext
                                    : FlagFileArgument(word, &argument);
    if (kind != FlagFile::kNone) plain = false;
    if (file_next) {
      word = FlagFileArgumentDigest(crypto, word, 1, problem);
      file_next = false;
    } else if (kind == FlagFile::kNext) {
      file_next = true;
    } else if (kind == FlagFile::kHere) {
      word = word.substr(0, word.find('=') + 1) +
             FlagFileArgumentDigest(crypto, argument, 1, problem);
    } else if (word[0] != '-' ||
               (absl_style && word.find('=') == std::string::npos)) {
      plain = false;
    }
    flags.push_back(word);
  }
  if (plain) {
    flags.erase(std::remove_if(flags.begin(), flags.end(),
                               [](const std::string& f) {
                                 return DebugOnly(SortName(f));
                               }),
                flags.end());
    std::stable_sort(flags.begin(), flags.end(),
                     [](const std::string& a, const std::string& b) {
                       return SortName(a) < SortName(b);
                     });
  }
  // Not plain: every word as written, in its order (flag files hashed).
  std::string out = plain ? "sorted:" : "as-written:";
  for (const std::string& flag : flags) out += " " + flag;
  return out;
}

std::vector<std::pair<std::string, std::string>> KeyedFlags(
    const Libcrypto& crypto, std::string* problem) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const char* name : kKeyedFlagEnvs) {
    const char* value = std::getenv(name);
    std::string why;
    out.emplace_back(name, NormalizedFlags(crypto, value ? value : "",
                                           std::strcmp(name,
                                                       "LIBTPU_INIT_ARGS") == 0,
                                           &why));
    if (!why.empty() && problem->empty()) *problem = std::string(name) + ": " + why;
  }
  return out;
}

std::string KeyedCodegenEnvironment() {
  std::string out;
  for (const char* name : kKeyedCodegenEnvs) {
    const char* value = std::getenv(name);
    out += std::string(name) + (value ? "=" + std::string(value) : " unset") +
           "\n";
  }
  return out;
}

std::string KeyedEnvironment(const Libcrypto& crypto, std::string* problem) {
  std::string out;
  for (const auto& [name, flags] : KeyedFlags(crypto, problem)) {
    out += name + "=" + flags + "\n";
  }
  return out + KeyedCodegenEnvironment();
}

}  // namespace pjrt_wrap
}  // namespace xlakit
