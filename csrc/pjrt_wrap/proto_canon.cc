// Canonical protobuf bytes; see proto_canon.h.
#include "pjrt_wrap/proto_canon.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "pjrt_wrap/mlir_bytecode.h"

namespace xlakit {
namespace pjrt_wrap {
namespace {

// What the canonicalizer knows of a message: which fields are maps, and
// which are messages that contain maps further down.
struct Schema {
  std::map<uint32_t, const Schema*> messages;
  std::map<uint32_t, bool> maps;
  // Fields left out of the canonical bytes: debug metadata that never changes
  // the executable (source locations).
  std::set<uint32_t> drop;
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

void AppendVarint(uint64_t value, std::string* out) {
  do {
    uint8_t byte = value & 0x7f;
    value >>= 7;
    out->push_back(static_cast<char>(value ? byte | 0x80 : byte));
  } while (value);
}

// One field of a message on the wire.
struct Field {
  uint32_t number = 0;
  size_t start = 0;           // where its tag starts
  size_t tag = 0;             // its tag's bytes
  size_t header = 0;          // tag and length bytes, for length-delimited fields
  bool delimited = false;     // a string, bytes or submessage: `payload` holds it
  std::string_view payload;
};

// Reads the field at `*pos` and moves past it; false if malformed (or a
// group, which these protos never use).
bool NextField(std::string_view in, size_t* pos, Field* field) {
  field->start = *pos;
  uint64_t tag = 0;
  uint64_t n = 0;
  if (!ReadVarint(in, pos, &tag)) return false;
  field->tag = *pos - field->start;
  field->number = static_cast<uint32_t>(tag >> 3);
  field->delimited = false;
  switch (tag & 7) {
    case kVarint:
      return ReadVarint(in, pos, &n);
    case kFixed64:
      *pos += 8;
      return *pos <= in.size();
    case kFixed32:
      *pos += 4;
      return *pos <= in.size();
    case kBytes:
      if (!ReadVarint(in, pos, &n) || n > in.size() - *pos) return false;
      field->delimited = true;
      field->header = *pos - field->start;
      field->payload = in.substr(*pos, n);
      *pos += n;
      return true;
    default:
      return false;
  }
}

// The key of a map entry (its field 1, as written), or nullopt.
std::optional<std::string> EntryKey(std::string_view entry) {
  Field field;
  for (size_t pos = 0; pos < entry.size();) {
    if (!NextField(entry, &pos, &field)) return std::nullopt;
    if (field.number == 1) {
      return std::string(entry.substr(field.start, pos - field.start));
    }
  }
  return std::string();  // a default key: absent on the wire
}

std::optional<std::string> Canon(std::string_view in, const Schema& schema) {
  std::string out;
  out.reserve(in.size());
  // Each map's entries, emitted sorted where its first entry stood.
  std::map<uint32_t, std::vector<std::pair<std::string, std::string>>> maps;
  std::vector<std::pair<size_t, uint32_t>> map_slots;  // (offset in out, field)
  Field field;
  for (size_t pos = 0; pos < in.size();) {
    if (!NextField(in, &pos, &field)) return std::nullopt;
    std::string_view whole = in.substr(field.start, pos - field.start);
    if (schema.drop.count(field.number)) continue;
    if (field.delimited && schema.maps.count(field.number)) {
      std::optional<std::string> key = EntryKey(field.payload);
      if (!key) return std::nullopt;
      if (maps.find(field.number) == maps.end()) {
        map_slots.emplace_back(out.size(), field.number);
      }
      maps[field.number].emplace_back(*key, std::string(whole));
      continue;
    }
    auto sub = schema.messages.find(field.number);
    if (field.delimited && sub != schema.messages.end()) {
      std::optional<std::string> inner = Canon(field.payload, *sub->second);
      if (!inner) return std::nullopt;
      // Its length changes where fields were dropped: the tag, then the new
      // length.
      out.append(whole.substr(0, field.tag));
      AppendVarint(inner->size(), &out);
      out.append(*inner);
      continue;
    }
    out.append(whole);
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

// The HLO module schema; `without_constants` also drops each instruction's
// literal (field 8, present only on constants), for ProgramWithoutConstants.
const Schema* MakeHloModuleSchema(bool without_constants) {
  auto* frontend_attributes = new Schema();
  frontend_attributes->maps = {{1, true}};  // map
  // OpMetadata: what the op was called in the framework and where it came
  // from in the user's source (a blank line added above it, or a renamed
  // scope, changes them); its other fields (preserve_layout, ...) stay.
  auto* op_metadata = new Schema();
  op_metadata->drop = {1,    // op_type
                       2,    // op_name
                       3,    // source_file
                       4,    // source_line
                       15,   // stack_frame_id (into stack_frame_index)
                       17,   // source_end_line
                       18,   // source_column
                       19};  // source_end_column
  auto* instruction = new Schema();
  instruction->messages = {{7, op_metadata},  // metadata
                           {68, frontend_attributes}};
  if (without_constants) instruction->drop = {8};  // literal
  auto* computation = new Schema();
  computation->messages = {{2, instruction}};  // instructions
  auto* schedule = new Schema();
  schedule->maps = {{1, true}};  // sequences
  auto* module = new Schema();
  module->messages = {{3, computation},            // computations
                      {7, schedule},               // schedule
                      {19, frontend_attributes}};  // frontend_attributes
  module->drop = {17};  // stack_frame_index: the source files, lines and
                        // functions the stack_frame_ids above point to
  return module;
}

const Schema& HloModuleSchema() {
  static const Schema* schema = MakeHloModuleSchema(false);
  return *schema;
}

const Schema& HloModuleWithoutConstantsSchema() {
  static const Schema* schema = MakeHloModuleSchema(true);
  return *schema;
}

}  // namespace

std::string CanonicalCompileOptions(std::string_view bytes) {
  std::optional<std::string> out = Canon(bytes, CompileOptionsSchema());
  return out ? *out : std::string(bytes);
}

std::string CanonicalProgram(std::string_view format, std::string_view bytes) {
  std::optional<std::string> out;
  if (format == "hlo") out = Canon(bytes, HloModuleSchema());
  if (format == "mlir") out = CanonicalMlirBytecode(bytes);
  return out ? *out : std::string(bytes);
}

std::string ProgramWithoutConstants(std::string_view format,
                                    std::string_view bytes) {
  if (format != "hlo") return "";
  std::optional<std::string> out =
      Canon(bytes, HloModuleWithoutConstantsSchema());
  return out ? *out : "";
}

std::string ModuleName(std::string_view format, std::string_view bytes) {
  if (format == "hlo") {
    Field field;
    for (size_t pos = 0; pos < bytes.size();) {
      if (!NextField(bytes, &pos, &field)) break;
      if (field.number == 1 && field.delimited) {  // HloModuleProto.name
        std::string name(field.payload.substr(0, 200));
        for (char& c : name) {
          if (c < 0x20 || c > 0x7e) c = '?';  // printable in a log line
        }
        return name.empty() ? "unknown" : name;
      }
    }
    return "unknown";
  }
  if (format != "mlir") return "unknown";
  // Text: `module @name`. Bytecode keeps its strings NUL-terminated in one
  // table; jax names its modules jit_<function> (pjit_ before 0.4.14), so the
  // first such string is the module's sym_name: a cheap guess, never parsed.
  auto plain = [](std::string_view s) {
    return !s.empty() && s.size() <= 200 &&
           s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRST"
                               "UVWXYZ0123456789_.$-") == std::string_view::npos;
  };
  size_t at = bytes.find("module @");
  if (bytes.rfind("ML\xefR", 0) != 0 && at != std::string_view::npos) {
    std::string_view rest = bytes.substr(at + 8);
    std::string_view name = rest.substr(0, rest.find_first_of(" {\n"));
    if (plain(name)) return std::string(name);
  }
  for (std::string_view prefix : {std::string_view("\0jit_", 5),
                                   std::string_view("\0pjit_", 6)}) {
    size_t start = bytes.find(prefix);
    if (start == std::string_view::npos) continue;
    std::string_view rest = bytes.substr(start + 1);
    std::string_view name = rest.substr(0, rest.find('\0'));
    if (name.size() < rest.size() && plain(name)) return std::string(name);
  }
  return "unknown";
}

}  // namespace pjrt_wrap
}  // namespace xlakit
