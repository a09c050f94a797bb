// Canonical protobuf bytes; see proto_canon.h.
#include "pjrt_wrap/proto_canon.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace xlakit {
namespace pjrt_wrap {
namespace {

// What the canonicalizer knows of a message: which fields are maps, and
// which are messages that contain maps further down.
struct Schema {
  std::map<uint32_t, const Schema*> messages;
  std::map<uint32_t, bool> maps;
};

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5 };

bool ReadVarint(std::string_view in, size_t* pos, uint64_t* out) {
  uint64_t value = 0;
  for (int shift = 0; shift < 64 && *pos < in.size(); shift += 7) {
    uint8_t byte = static_cast<uint8_t>(in[(*pos)++]);
    value |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if ((byte & 0x80) == 0) {
      *out = value;
      return true;
    }
  }
  return false;
}

std::optional<std::string> Canon(std::string_view in, const Schema& schema);

// The key bytes of a map entry (its field 1, as written), or nullopt.
std::optional<std::string> EntryKey(std::string_view entry) {
  size_t pos = 0;
  while (pos < entry.size()) {
    uint64_t tag = 0;
    size_t start = pos;
    if (!ReadVarint(entry, &pos, &tag)) return std::nullopt;
    uint64_t n = 0;
    switch (tag & 7) {
      case kVarint:
        if (!ReadVarint(entry, &pos, &n)) return std::nullopt;
        break;
      case kFixed64:
        pos += 8;
        break;
      case kFixed32:
        pos += 4;
        break;
      case kBytes:
        if (!ReadVarint(entry, &pos, &n) || n > entry.size() - pos) {
          return std::nullopt;
        }
        pos += n;
        break;
      default:
        return std::nullopt;
    }
    if (pos > entry.size()) return std::nullopt;
    if ((tag >> 3) == 1) return std::string(entry.substr(start, pos - start));
  }
  return std::string();  // a default key: absent on the wire
}

std::optional<std::string> Canon(std::string_view in, const Schema& schema) {
  std::string out;
  out.reserve(in.size());
  // Each map's entries, emitted sorted where its first entry stood.
  std::map<uint32_t, std::vector<std::pair<std::string, std::string>>> maps;
  std::vector<std::pair<size_t, uint32_t>> map_slots;  // (offset in out, field)
  size_t pos = 0;
  while (pos < in.size()) {
    size_t start = pos;
    uint64_t tag = 0;
    if (!ReadVarint(in, &pos, &tag)) return std::nullopt;
    const uint32_t field = static_cast<uint32_t>(tag >> 3);
    uint64_t n = 0;
    switch (tag & 7) {
      case kVarint:
        if (!ReadVarint(in, &pos, &n)) return std::nullopt;
        break;
      case kFixed64:
        pos += 8;
        break;
      case kFixed32:
        pos += 4;
        break;
      case kBytes: {
        if (!ReadVarint(in, &pos, &n) || n > in.size() - pos) {
          return std::nullopt;
        }
        std::string_view payload = in.substr(pos, n);
        size_t header = pos - start;
        pos += n;
        if (schema.maps.count(field)) {
          std::optional<std::string> key = EntryKey(payload);
          if (!key) return std::nullopt;
          if (maps.find(field) == maps.end()) {
            map_slots.emplace_back(out.size(), field);
          }
          maps[field].emplace_back(*key, std::string(in.substr(start, pos - start)));
          continue;
        }
        auto sub = schema.messages.find(field);
        if (sub != schema.messages.end()) {
          std::optional<std::string> inner = Canon(payload, *sub->second);
          if (!inner) return std::nullopt;
          // Same length as before: only entries moved, so the header stands.
          out.append(in.substr(start, header));
          out.append(*inner);
          continue;
        }
        break;
      }
      default:
        return std::nullopt;  // groups: never used by these protos
    }
    if (pos > in.size()) return std::nullopt;
    out.append(in.substr(start, pos - start));
  }
  // Insert the sorted maps, last slot first so earlier offsets stay valid.
  for (auto it = map_slots.rbegin(); it != map_slots.rend(); ++it) {
    auto& entries = maps[it->second];
    std::sort(entries.begin(), entries.end());
    for (size_t i = 1; i < entries.size(); ++i) {
      if (entries[i].first == entries[i - 1].first) return std::nullopt;
    }
    std::string run;
    for (const auto& entry : entries) run += entry.second;
    out.insert(it->first, run);
  }
  return out;
}

const Schema& CompileOptionsSchema() {
  static const Schema* schema = [] {
    auto* debug_options = new Schema();
    debug_options->maps = {{357, true},   // xla_gpu_analytical_latency_estimator_options
                           {500, true}};  // xla_backend_extra_options
    auto* build_options = new Schema();
    build_options->messages = {{3, debug_options}};  // debug_options
    auto* compile_options = new Schema();
    compile_options->messages = {{3, build_options}};  // executable_build_options
    compile_options->maps = {{7, true}};                // env_option_overrides
    return compile_options;
  }();
  return *schema;
}

const Schema& HloModuleSchema() {
  static const Schema* schema = [] {
    auto* frontend_attributes = new Schema();
    frontend_attributes->maps = {{1, true}};  // map
    auto* instruction = new Schema();
    instruction->messages = {{68, frontend_attributes}};
    auto* computation = new Schema();
    computation->messages = {{2, instruction}};  // instructions
    auto* schedule = new Schema();
    schedule->maps = {{1, true}};  // sequences
    auto* module = new Schema();
    module->messages = {{3, computation},            // computations
                        {7, schedule},               // schedule
                        {19, frontend_attributes}};  // frontend_attributes
    return module;
  }();
  return *schema;
}

}  // namespace

std::string CanonicalCompileOptions(std::string_view bytes) {
  std::optional<std::string> out = Canon(bytes, CompileOptionsSchema());
  return out ? *out : std::string(bytes);
}

std::string CanonicalProgram(std::string_view format, std::string_view bytes) {
  if (format != "hlo") return std::string(bytes);
  std::optional<std::string> out = Canon(bytes, HloModuleSchema());
  return out ? *out : std::string(bytes);
}

}  // namespace pjrt_wrap
}  // namespace xlakit
