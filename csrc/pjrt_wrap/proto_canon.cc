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

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5 };

// What the canonicalizer knows of a message: which fields are maps (and how
// their keys are encoded), which are messages that contain maps or dropped
// fields further down, and which fields it leaves out. Everything else is
// kept byte for byte, in its place.
struct Schema {
  std::map<uint32_t, const Schema*> messages;
  std::map<uint32_t, WireType> maps;  // field -> its entries' key wire type
  // Fields left out of the canonical bytes: debug metadata that never changes
  // the executable (source locations), each with the wire type it has in the
  // proto. A field whose wire type differs is another (unknown) field: kept.
  std::map<uint32_t, WireType> drop;
  // Within a dropped field (or one it holds): the string fields, which a
  // proto3 parser refuses unless they are UTF-8, and the message fields.
  std::set<uint32_t> strings;
};

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

size_t VarintSize(uint64_t value) {
  size_t n = 1;
  while (value >>= 7) ++n;
  return n;
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
  WireType wire = kVarint;
  size_t start = 0;           // where its tag starts
  size_t tag = 0;             // its tag's bytes
  bool canonical_tag = false;  // the shortest encoding of a valid tag
  bool delimited = false;     // a string, bytes or submessage: `payload` holds it
  bool canonical_length = false;  // its length's shortest encoding
  uint64_t value = 0;         // a varint field's value
  bool canonical_value = false;   // ... in its shortest encoding
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
  field->wire = static_cast<WireType>(tag & 7);
  field->canonical_tag = tag >> 32 == 0 && field->number != 0 &&
                         field->tag == VarintSize(tag);
  field->delimited = false;
  switch (tag & 7) {
    case kVarint: {
      const size_t at = *pos;
      if (!ReadVarint(in, pos, &field->value)) return false;
      field->canonical_value = *pos - at == VarintSize(field->value);
      return true;
    }
    case kFixed64:
      if (in.size() - *pos < 8) return false;
      *pos += 8;
      return true;
    case kFixed32:
      if (in.size() - *pos < 4) return false;
      *pos += 4;
      return true;
    case kBytes: {
      const size_t at = *pos;
      if (!ReadVarint(in, pos, &n) || n > in.size() - *pos) return false;
      field->canonical_length = *pos - at == VarintSize(n);
      field->delimited = true;
      field->payload = in.substr(*pos, n);
      *pos += n;
      return true;
    }
    default:
      return false;
  }
}

bool Utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char lead = static_cast<unsigned char>(s[i]);
    const size_t n = lead < 0x80                    ? 1
                     : lead >= 0xC2 && lead <= 0xDF ? 2
                     : lead >= 0xE0 && lead <= 0xEF ? 3
                     : lead >= 0xF0 && lead <= 0xF4 ? 4
                                                    : 0;
    if (n == 0 || n > s.size() - i) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    const unsigned char next = n > 1 ? static_cast<unsigned char>(s[i + 1]) : 0;
    if ((lead == 0xE0 && next < 0xA0) || (lead == 0xED && next > 0x9F) ||
        (lead == 0xF0 && next < 0x90) || (lead == 0xF4 && next > 0x8F)) {
      return false;  // overlong, a surrogate, past U+10FFFF
    }
    i += n;
  }
  return true;
}

// Whether a protobuf parser takes `in` as a message of `schema`: well formed,
// its known strings UTF-8, its known messages so too. A field is dropped only
// when this holds, so a program a parser refuses never shares a key with one
// it accepts.
bool Parses(std::string_view in, const Schema& schema, int depth) {
  Field field;
  for (size_t pos = 0; pos < in.size();) {
    if (!NextField(in, &pos, &field) || field.number == 0) return false;
    if (!field.delimited) continue;
    if (schema.strings.count(field.number) && !Utf8(field.payload)) return false;
    auto sub = schema.messages.find(field.number);
    if (sub != schema.messages.end() &&
        (depth > 32 || !Parses(field.payload, *sub->second, depth + 1))) {
      return false;
    }
  }
  return true;
}

// Whether `field` is left out of the canonical bytes: a field `schema` drops,
// with its wire type and its tag's shortest encoding (so that the bytes left
// out are exactly that field, as any parser reads it), its value one that a
// parser takes.
bool Dropped(const Field& field, const Schema& schema, int depth) {
  auto it = schema.drop.find(field.number);
  if (it == schema.drop.end() || it->second != field.wire ||
      !field.canonical_tag) {
    return false;
  }
  if (field.wire != kBytes) return true;
  if (schema.strings.count(field.number)) return Utf8(field.payload);
  auto sub = schema.messages.find(field.number);
  return sub == schema.messages.end() ||
         Parses(field.payload, *sub->second, depth + 1);
}

// The key of a map entry as protobuf decodes it, as bytes that are equal
// exactly when the keys are: a string's bytes, an integer's shortest varint.
// nullopt unless the entry is plain: at most one key (field 1) of its wire
// type and at most one value (field 2), each with its tag's shortest
// encoding (an integer key in its shortest encoding too), nothing else. For
// such an entry every parser reads the key written; any other is refused
// (the caller keys the bytes as they are).
std::optional<std::string> EntryKey(std::string_view entry, WireType key_wire) {
  Field field;
  bool has_key = false, has_value = false;
  std::string key = key_wire == kBytes ? "" : std::string(1, '\0');
  for (size_t pos = 0; pos < entry.size();) {
    if (!NextField(entry, &pos, &field) || !field.canonical_tag) {
      return std::nullopt;
    }
    if (field.number == 1 && field.wire == key_wire && !has_key) {
      has_key = true;
      if (key_wire == kBytes) {
        key = std::string(field.payload);
      } else if (field.canonical_value) {
        key.clear();
        AppendVarint(field.value, &key);
      } else {
        return std::nullopt;
      }
    } else if (field.number == 2 && !has_value) {
      has_value = true;
    } else {
      return std::nullopt;
    }
  }
  return key;
}

std::optional<std::string> Canon(std::string_view in, const Schema& schema,
                                 int depth = 0) {
  if (depth > 32) return std::nullopt;
  std::string out;
  out.reserve(in.size());
  // Each map's entries, emitted sorted where its first entry stood.
  std::map<uint32_t, std::vector<std::pair<std::string, std::string>>> maps;
  std::vector<std::pair<size_t, uint32_t>> map_slots;  // (offset in out, field)
  Field field;
  for (size_t pos = 0; pos < in.size();) {
    if (!NextField(in, &pos, &field)) return std::nullopt;
    std::string_view whole = in.substr(field.start, pos - field.start);
    if (Dropped(field, schema, depth)) continue;
    auto map = schema.maps.find(field.number);
    if (field.delimited && map != schema.maps.end()) {
      std::optional<std::string> key = EntryKey(field.payload, map->second);
      if (!key) return std::nullopt;
      if (maps.find(field.number) == maps.end()) {
        map_slots.emplace_back(out.size(), field.number);
      }
      maps[field.number].emplace_back(*key, std::string(whole));
      continue;
    }
    auto sub = schema.messages.find(field.number);
    if (field.delimited && sub != schema.messages.end()) {
      // Its length is written again below: only from its shortest encoding,
      // the one every parser takes.
      if (!field.canonical_length) return std::nullopt;
      std::optional<std::string> inner =
          Canon(field.payload, *sub->second, depth + 1);
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
  // A key twice is refused: protobuf keeps the last, which a sort would move.
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
    debug_options->maps = {
        {357, kBytes},   // xla_gpu_analytical_latency_estimator_options
        {500, kBytes}};  // xla_backend_extra_options
    auto* build_options = new Schema();
    build_options->messages = {{3, debug_options}};  // debug_options
    auto* compile_options = new Schema();
    compile_options->messages = {{3, build_options}};  // executable_build_options
    compile_options->maps = {{7, kBytes}};             // env_option_overrides
    return compile_options;
  }();
  return *schema;
}

// The HLO module schema; `without_constants` also drops each instruction's
// literal (field 8, present only on constants), for ProgramWithoutConstants.
const Schema* MakeHloModuleSchema(bool without_constants) {
  auto* frontend_attributes = new Schema();
  frontend_attributes->maps = {{1, kBytes}};  // map<string, string>
  // OpMetadata: what the op was called in the framework and where it came
  // from in the user's source (a blank line added above it, or a renamed
  // scope, changes them); its other fields (preserve_layout, ...) stay.
  auto* op_metadata = new Schema();
  op_metadata->drop = {{1, kBytes},    // op_type
                       {2, kBytes},    // op_name
                       {3, kBytes},    // source_file
                       {4, kVarint},   // source_line
                       {15, kVarint},  // stack_frame_id (into stack_frame_index)
                       {17, kVarint},  // source_end_line
                       {18, kVarint},  // source_column
                       {19, kVarint}};  // source_end_column
  op_metadata->strings = {1, 2, 3};
  auto* instruction = new Schema();
  instruction->messages = {{7, op_metadata},  // metadata
                           {68, frontend_attributes}};
  if (without_constants) instruction->drop = {{8, kBytes}};  // literal
  auto* computation = new Schema();
  computation->messages = {{2, instruction}};  // instructions
  auto* schedule = new Schema();
  schedule->maps = {{1, kVarint}};  // sequences: map<int64, ...>
  // StackFrameIndexProto: file_names and function_names (strings), file
  // locations and frames (integers only).
  auto* stack_frame_index = new Schema();
  stack_frame_index->strings = {1, 2};
  auto* module = new Schema();
  module->messages = {{3, computation},            // computations
                      {7, schedule},               // schedule
                      {17, stack_frame_index},
                      {19, frontend_attributes}};  // frontend_attributes
  module->drop = {{17, kBytes}};  // stack_frame_index: the source files, lines
                                  // and functions the stack_frame_ids above
                                  // point to
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
