// The environment's part of a cache key; see key_parts.h.
#include "pjrt_wrap/key_parts.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
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

std::string FileContentsDigest(const Libcrypto& crypto,
                               const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "unreadable:" + path;
  std::ostringstream contents;
  contents << in.rdbuf();
  Sha256 sha(crypto);
  sha.Update(contents.str());
  return "sha256:" + sha.Hex();
}

}  // namespace

std::string NormalizedFlags(const Libcrypto& crypto, const std::string& value,
                            bool absl_style) {
  static const char kFlagFile[] = "--flagfile=";
  std::vector<std::string> flags;
  std::istringstream words(value);
  bool plain = value.find_first_of("'\"\\") == std::string::npos;
  for (std::string word; words >> word;) {
    if (word.rfind(kFlagFile, 0) == 0) {
      plain = false;
      word = kFlagFile + FileContentsDigest(crypto, word.substr(sizeof(kFlagFile) - 1));
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
    const Libcrypto& crypto) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const char* name : kKeyedFlagEnvs) {
    const char* value = std::getenv(name);
    out.emplace_back(name, NormalizedFlags(crypto, value ? value : "",
                                           std::strcmp(name,
                                                       "LIBTPU_INIT_ARGS") == 0));
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

std::string KeyedEnvironment(const Libcrypto& crypto) {
  std::string out;
  for (const auto& [name, flags] : KeyedFlags(crypto)) {
    out += name + "=" + flags + "\n";
  }
  return out + KeyedCodegenEnvironment();
}

}  // namespace pjrt_wrap
}  // namespace xlakit
