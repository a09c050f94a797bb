// Key records and miss explanations; see key_record.h.
#include "pjrt_wrap/key_record.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <set>
#include <sstream>

#include "pjrt_wrap/compile_cache.h"
#include "pjrt_wrap/counters.h"
#include "pjrt_wrap/proto_canon.h"

namespace xlakit {
namespace pjrt_wrap {
namespace {

std::string Find(const std::vector<std::pair<std::string, std::string>>& v,
                 const std::string& name) {
  for (const auto& [k, value] : v) {
    if (k == name) return value;
  }
  return "";
}

// A JSON string starting at `*pos` (its opening quote), unescaped as
// JsonString escapes; false if it is not one.
bool ReadString(std::string_view s, size_t* pos, std::string* out) {
  if (*pos >= s.size() || s[*pos] != '"') return false;
  out->clear();
  for (size_t i = *pos + 1; i < s.size(); ++i) {
    char c = s[i];
    if (c == '"') {
      *pos = i + 1;
      return true;
    }
    if (c != '\\') {
      out->push_back(c);
      continue;
    }
    if (++i >= s.size()) return false;
    switch (s[i]) {
      case '"': case '\\': case '/': out->push_back(s[i]); break;
      case 'n': out->push_back('\n'); break;
      case 'r': out->push_back('\r'); break;
      case 't': out->push_back('\t'); break;
      case 'u': {
        if (i + 4 >= s.size()) return false;
        unsigned value = 0;
        for (int k = 1; k <= 4; ++k) {
          char h = s[i + k];
          value = value * 16 + (h >= '0' && h <= '9'   ? h - '0'
                                : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                                       : 0);
        }
        out->push_back(value < 0x80 ? static_cast<char>(value) : '?');
        i += 4;
        break;
      }
      default:
        return false;
    }
  }
  return false;
}

std::vector<std::string> Words(const std::string& flags) {
  std::vector<std::string> out;
  std::istringstream in(flags);
  for (std::string w; in >> w;) out.push_back(w);
  if (!out.empty() && out[0].back() == ':') out.erase(out.begin());  // sorted:
  return out;
}

// "XLA_FLAGS (this job: --a=1; the entry: --a=0)": the words one side has and
// the other lacks.
std::string FlagChange(const std::string& name, const std::string& mine,
                       const std::string& theirs) {
  std::vector<std::string> a = Words(mine), b = Words(theirs);
  std::set<std::string> sa(a.begin(), a.end()), sb(b.begin(), b.end());
  std::string only_a, only_b;
  for (const std::string& w : a) {
    if (!sb.count(w)) only_a += (only_a.empty() ? "" : " ") + w;
  }
  for (const std::string& w : b) {
    if (!sa.count(w)) only_b += (only_b.empty() ? "" : " ") + w;
  }
  if (only_a.empty() && only_b.empty()) {
    return name + " (the same flags in another order, kept as written)";
  }
  return name + " (this job: " + (only_a.empty() ? "-" : only_a) +
         "; the entry: " + (only_b.empty() ? "-" : only_b) + ")";
}

std::string LineChange(const std::string& mine, const std::string& theirs) {
  std::vector<std::string> a, b;
  std::istringstream ia(mine), ib(theirs);
  for (std::string l; std::getline(ia, l, ';');) a.push_back(l);
  for (std::string l; std::getline(ib, l, ';');) b.push_back(l);
  std::string out;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (a[i] != b[i]) out += (out.empty() ? "" : ", ") + a[i] + " (the entry: " + b[i] + ")";
  }
  return out;
}

// The parts a miss is explained by, in this order.
const char* const kExplained[] = {
    "program",       "compile_options", "XLA_FLAGS",       "TF_XLA_FLAGS",
    "LIBTPU_INIT_ARGS", "codegen_env",  "plugin_build",    "platform",
    "topology",      "wrapper_version", "key_id"};

}  // namespace

std::string KeyRecord::Part(const std::string& name) const {
  return Find(parts, name);
}

std::string KeyRecord::Detail(const std::string& name) const {
  return Find(details, name);
}

KeyRecord MakeKeyRecord(const Libcrypto& crypto, const KeyRecordInputs& in,
                        const PJRT_Client_Compile_Args& args) {
  KeyRecord r;
  const PJRT_Program* program = args.program;
  if (program == nullptr || program->code == nullptr) return r;
  auto hash = [&crypto](std::string_view text) {
    Sha256 sha(crypto);
    sha.Update(text);
    return sha.Hex().substr(0, 32);
  };
  std::string_view format(program->format ? program->format : "",
                          program->format ? program->format_size : 0);
  std::string_view code(program->code, program->code_size);
  r.program_format = std::string(format);
  r.module = ModuleName(format, code);
  r.parts.emplace_back(
      "program", hash(r.program_format + '\0' + CanonicalProgram(format, code)));
  std::string bare = ProgramWithoutConstants(format, code);
  if (!bare.empty()) {
    r.parts.emplace_back("program_without_constants", hash(bare));
  }
  r.parts.emplace_back(
      "compile_options",
      hash(CanonicalCompileOptions(std::string_view(
          args.compile_options ? args.compile_options : "",
          args.compile_options ? args.compile_options_size : 0))));
  for (const auto& [name, flags] : *in.flags) {
    r.parts.emplace_back(name, hash(flags));
    // LIBTPU_INIT_ARGS may carry secrets (credentials of a TPU service):
    // hashed only.
    if (name != "LIBTPU_INIT_ARGS") r.details.emplace_back(name, flags);
  }
  std::string codegen = in.codegen_env;
  std::replace(codegen.begin(), codegen.end(), '\n', ';');
  if (!codegen.empty()) codegen.pop_back();
  r.parts.emplace_back("codegen_env", hash(in.codegen_env));
  r.details.emplace_back("codegen_env", codegen);
  r.parts.emplace_back("plugin_build", hash(in.plugin_build));
  r.details.emplace_back("plugin_build", in.plugin_build);
  r.parts.emplace_back("platform", hash(in.platform_name + '\n' +
                                        in.platform_version));
  r.details.emplace_back("platform", in.platform_name + " " +
                                        in.platform_version);
  r.parts.emplace_back("topology", hash(in.topology));
  r.details.emplace_back("topology", in.topology_source);
  r.parts.emplace_back("wrapper_version", kWrapperVersion);
  r.parts.emplace_back("key_id", in.key_id.empty() ? "none" : in.key_id);
  return r;
}

std::string KeyRecordJson(const KeyRecord& r, const std::string& entry) {
  std::string out = "{\n";
  out += "  \"format\": " + JsonString(kPartsFormat) + ",\n";
  out += "  \"entry\": " + JsonString(entry) + ",\n";
  out += "  \"module\": " + JsonString(r.module) + ",\n";
  out += "  \"program_format\": " + JsonString(r.program_format) + ",\n";
  // To the microsecond: a job writes several entries of one module a second.
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  char when[40];
  std::snprintf(when, sizeof(when), "%lld.%06ld",
                static_cast<long long>(now.tv_sec), now.tv_nsec / 1000);
  out += std::string("  \"written_unix_s\": ") + when + ",\n";
  auto object = [&out](const char* name, const auto& fields, bool last) {
    out += std::string("  \"") + name + "\": {\n";
    for (size_t i = 0; i < fields.size(); ++i) {
      out += "    " + JsonString(fields[i].first) + ": " +
             JsonString(fields[i].second) +
             (i + 1 < fields.size() ? ",\n" : "\n");
    }
    out += last ? "  }\n" : "  },\n";
  };
  object("parts", r.parts, false);
  object("details", r.details, true);
  return out + "}\n";
}

bool ParseKeyRecord(std::string_view json, const std::string& entry,
                    KeyRecord* r) {
  std::string section, format, stored;
  *r = KeyRecord();
  std::istringstream lines{std::string(json)};
  for (std::string line; std::getline(lines, line);) {
    size_t pos = line.find_first_not_of(' ');
    if (pos == std::string::npos) continue;
    if (line[pos] == '}') {
      section.clear();
      continue;
    }
    std::string name, value;
    if (!ReadString(line, &pos, &name)) continue;  // "{" and junk
    if (line.compare(pos, 2, ": ") != 0) return false;
    pos += 2;
    if (line.compare(pos, 1, "{") == 0) {
      section = name;
      continue;
    }
    if (!ReadString(line, &pos, &value)) continue;  // a number
    if (section == "parts") {
      r->parts.emplace_back(name, value);
    } else if (section == "details") {
      r->details.emplace_back(name, value);
    } else if (section.empty()) {
      if (name == "format") format = value;
      if (name == "entry") stored = value;
      if (name == "module") r->module = value;
      if (name == "program_format") r->program_format = value;
    }
  }
  return format == kPartsFormat && stored == entry && !r->parts.empty();
}

std::vector<std::string> Differences(const KeyRecord& mine,
                                     const KeyRecord& other) {
  std::vector<std::string> out;
  for (const char* part : kExplained) {
    const std::string a = mine.Part(part), b = other.Part(part);
    if (a == b) continue;
    const std::string name = part;
    if (name == "program") {
      const std::string ca = mine.Part("program_without_constants");
      const std::string cb = other.Part("program_without_constants");
      out.push_back(
          !ca.empty() && ca == cb
              ? "only the program's constants: the constant trap, a Python "
                "number baked into the graph (.item(), a step counter, AdamW "
                "without capturable=True) makes a new program each time; "
                "keep it a device tensor "
                "(torch.optim.AdamW(..., capturable=True))"
              : "the program");
    } else if (name == "XLA_FLAGS" || name == "TF_XLA_FLAGS") {
      out.push_back(FlagChange(name, mine.Detail(name), other.Detail(name)));
    } else if (name == "LIBTPU_INIT_ARGS") {
      out.push_back("LIBTPU_INIT_ARGS (its values are not recorded: they may "
                    "hold secrets)");
    } else if (name == "codegen_env") {
      out.push_back("the code-generation variables (" +
                    LineChange(mine.Detail(name), other.Detail(name)) + ")");
    } else if (name == "plugin_build" || name == "platform") {
      out.push_back("the " + std::string(name == "platform" ? "platform"
                                                            : "plugin build") +
                    " (this job: " + mine.Detail(name) +
                    "; the entry: " + other.Detail(name) + ")");
    } else if (name == "compile_options") {
      out.push_back("the compile options");
    } else if (name == "topology") {
      out.push_back("the topology");
    } else if (name == "wrapper_version") {
      out.push_back("the wrapper version (" + a + ", the entry " + b + ")");
    } else {
      out.push_back("the cache key (XLAKIT_CACHE_KEY id " + a +
                    ", the entry " + b + ")");
    }
  }
  return out;
}

std::string ExplainMiss(const KeyRecord& mine, const std::string& dir,
                        const std::string& key) {
  const std::string head = "cache miss, module " + mine.module + ": ";
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return head + "no entry of this module yet";
  const std::string suffix = kPartsSuffix;
  size_t same_module = 0;
  size_t best_count = SIZE_MAX;
  int64_t best_time = 0;
  std::string best_name;
  std::vector<std::string> best;
  while (struct dirent* e = readdir(d)) {
    std::string name = e->d_name;
    if (name.size() != 64 + suffix.size() ||
        name.compare(64, std::string::npos, suffix) != 0 ||
        name.compare(0, 64, key) == 0) {
      continue;
    }
    int fd = openat(dirfd(d), e->d_name,
                    O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) continue;
    struct stat st;
    std::string text;
    if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
        static_cast<size_t>(st.st_size) <= kMaxPartsBytes) {
      text.resize(static_cast<size_t>(st.st_size));
      ssize_t n = read(fd, text.data(), text.size());
      text.resize(n > 0 ? static_cast<size_t>(n) : 0);
    }
    close(fd);
    KeyRecord other;
    if (!ParseKeyRecord(text, name.substr(0, 64), &other) ||
        other.module != mine.module) {
      continue;
    }
    ++same_module;
    std::vector<std::string> diff = Differences(mine, other);
    const int64_t when = int64_t{st.st_mtim.tv_sec} * 1000000000 +
                         st.st_mtim.tv_nsec;
    if (diff.size() < best_count ||
        (diff.size() == best_count && when > best_time)) {
      best_count = diff.size();
      best_time = when;
      best_name = name.substr(0, 12);
      best = std::move(diff);
    }
  }
  closedir(d);
  if (same_module == 0) return head + "no entry of this module yet";
  std::string out = head + "the nearest of its " +
                    std::to_string(same_module) + " entries (" + best_name +
                    ") differs in ";
  if (best.empty()) {
    return out + "nothing recorded (its entry was refused, or its record "
                 "is stale)";
  }
  for (size_t i = 0; i < best.size(); ++i) {
    out += (i ? "; " : "") + best[i];
  }
  return out;
}

}  // namespace pjrt_wrap
}  // namespace xlakit
