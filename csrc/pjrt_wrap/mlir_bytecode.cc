// Canonical MLIR bytecode with locations neutralised; see mlir_bytecode.h.
#include "pjrt_wrap/mlir_bytecode.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <vector>

namespace xlakit {
namespace pjrt_wrap {
namespace {

// MLIR's section ids (mlir/include/mlir/Bytecode/Encoding.h).
enum Section : uint8_t {
  kString = 0, kDialect = 1, kAttrType = 2, kAttrTypeOffset = 3, kIR = 4,
  kResource = 5, kResourceOffset = 6, kDialectVersions = 7, kProperties = 8,
};

// Builtin attribute codes (mlir/include/mlir/IR/BuiltinDialectBytecode.td,
// the order of BuiltinDialectAttributes; checked against jaxlib's programs).
enum Builtin : uint64_t {
  kArray = 0, kDictionary = 1, kStringAttr = 2, kStringWithType = 3,
  kFlatSymbolRef = 4, kSymbolRef = 5, kTypeAttr = 6, kUnit = 7, kInteger = 8,
  kFloat = 9, kCallSiteLoc = 10, kFileLineColLoc = 11, kFusedLoc = 12,
  kFusedLocWithMetadata = 13, kNameLoc = 14, kUnknownLoc = 15,
  kDenseResource = 16, kDenseArray = 17, kDenseIntOrFP = 18,
  kDenseString = 19, kSparse = 20, kDistinct = 21, kFileLineColRange = 22,
};

// MLIR's prefix varint: the first byte's trailing zeros say how many more
// bytes follow (0x00: eight). Its length from the first byte.
size_t VarIntLength(uint8_t first) {
  if (first == 0) return 9;
  size_t n = 1;
  while (!(first & (1u << (n - 1)))) ++n;
  return n;
}

// The value of the `n`-byte varint at `p`.
uint64_t DecodeVarInt(const char* p, size_t n) {
  uint64_t value = 0;
  if (n == 9) {
    for (size_t i = 0; i < 8; ++i) value |= uint64_t(uint8_t(p[1 + i])) << (8 * i);
    return value;
  }
  for (size_t i = 0; i < n; ++i) value |= uint64_t(uint8_t(p[i])) << (8 * i);
  return value >> n;
}

// The length of the shortest encoding of `value` (what MLIR's writer emits).
size_t VarIntSize(uint64_t value) {
  if (value >> 56) return 9;
  size_t n = 1;
  while (n < 8 && (value >> (7 * n))) ++n;
  return n;
}

class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  bool empty() const { return pos_ == data_.size(); }
  size_t size() const { return data_.size() - pos_; }  // bytes left
  size_t pos() const { return pos_; }
  bool VarInt(uint64_t* out) {
    if (pos_ >= data_.size()) return false;
    const size_t n = VarIntLength(static_cast<uint8_t>(data_[pos_]));
    if (data_.size() - pos_ < n) return false;
    const uint64_t value = DecodeVarInt(data_.data() + pos_, n);
    // Only the shortest encoding, the one MLIR's writer emits: a value read
    // here then has exactly one spelling, so the bytes kept and the values
    // read determine each other.
    if (n != VarIntSize(value)) return false;
    pos_ += n;
    *out = value;
    return true;
  }
  bool Flagged(uint64_t* value, bool* flag) {
    if (!VarInt(value)) return false;
    *flag = *value & 1;
    *value >>= 1;
    return true;
  }
  bool Byte(uint8_t* out) {
    if (pos_ >= data_.size()) return false;
    *out = static_cast<uint8_t>(data_[pos_++]);
    return true;
  }
  bool Bytes(size_t n, std::string_view* out) {
    if (data_.size() - pos_ < n) return false;
    *out = data_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  void Rest() { pos_ = data_.size(); }
  bool CString(std::string_view* out) {
    size_t end = data_.find('\0', pos_);
    if (end == std::string_view::npos) return false;
    *out = data_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return true;
  }
  // A list: its count, then `each` that many times.
  template <typename F>
  bool List(F each) {
    uint64_t n = 0;
    if (!VarInt(&n) || n > data_.size()) return false;
    for (uint64_t i = 0; i < n; ++i) {
      if (!each()) return false;
    }
    return true;
  }

 private:
  std::string_view data_;
  size_t pos_ = 0;
};

// The shortest encoding of `value` as an MLIR varint (the writer's).
std::string EncodeVarInt(uint64_t value) {
  std::string out;
  if (value >> 56) {
    out.push_back('\0');
    for (int i = 0; i < 8; ++i) out.push_back(char(value >> (8 * i)));
    return out;
  }
  size_t n = 1;
  while (n < 8 && (value >> (7 * n))) ++n;
  uint64_t encoded = ((value << 1) | 1) << (n - 1);
  for (size_t i = 0; i < n; ++i) out.push_back(char(encoded >> (8 * i)));
  return out;
}

void Put(uint64_t value, std::string* out) {  // fixed 8 bytes, little endian
  for (int i = 0; i < 8; ++i) out->push_back(char(value >> (8 * i)));
}

void PutBytes(std::string_view bytes, std::string* out) {
  Put(bytes.size(), out);
  out->append(bytes);
}

struct Entry {
  bool is_attr = true;
  uint64_t dialect = 0;
  bool custom = false;
  std::string_view data;
  bool location = false;  // a builtin location, custom encoded
  bool opaque = false;    // references unknown: scanned from `scan_from`
  size_t scan_from = 0;
  // A builtin location's references: every attribute it names, and those
  // MLIR reads as a LocationAttr or a StringAttr (checked, as MLIR's reader
  // does: a program it would refuse is never one key with one it accepts).
  std::vector<uint64_t> refs;
  std::vector<uint64_t> must_be_locations;
  std::vector<uint64_t> must_be_strings;
  int64_t file_name = -1;  // FileLineColLoc/Range: its file name attribute
};

struct Program {
  std::map<uint8_t, std::pair<uint64_t, std::string_view>> sections;  // align, data
  std::vector<uint8_t> order;
  std::vector<std::string_view> strings;
  std::vector<std::string_view> dialects;
  std::vector<Entry> entries;  // attributes, then types
  uint64_t num_attrs = 0;
  std::string groups;  // the offset section's grouping, sizes left out
  // Pieces that are not attribute or type entries and may name anything:
  // dialect versions, properties, the resource offsets.
  std::vector<std::string_view> opaque;
  std::set<uint64_t> strings_named_elsewhere;  // by what is not a StringAttr
  std::map<uint64_t, uint64_t> string_of_attr;  // builtin StringAttr -> string
  std::set<uint64_t> string_attrs;             // StringAttr, with a type or not
  std::set<uint64_t> attrs_named_elsewhere;    // by a builtin non-location
  // Operation names (dialect, name), registered or not, by index.
  std::vector<std::pair<std::string_view, std::string_view>> op_names;
  std::vector<bool> op_registered;
  std::vector<std::string_view> properties;  // each op's encoded properties
};

bool ReadStrings(std::string_view data, Program* p) {
  Reader r(data);
  uint64_t n = 0;
  if (!r.VarInt(&n) || n > data.size()) return false;
  std::vector<uint64_t> sizes(n);
  for (uint64_t i = 0; i < n; ++i) {
    if (!r.VarInt(&sizes[n - 1 - i])) return false;  // written in reverse
  }
  size_t at = r.pos();
  p->strings.resize(n);
  for (uint64_t i = 0; i < n; ++i) {
    if (sizes[i] == 0 || sizes[i] > data.size() - at) return false;
    if (data[at + sizes[i] - 1] != '\0') return false;
    p->strings[i] = data.substr(at, sizes[i] - 1);
    at += sizes[i];
  }
  return at == data.size();
}

bool ReadDialects(std::string_view data, Program* p) {
  Reader r(data);
  bool ok = r.List([&] {
    uint64_t name = 0;
    bool versioned = false;
    if (!r.Flagged(&name, &versioned) || name >= p->strings.size()) return false;
    p->strings_named_elsewhere.insert(name);
    p->dialects.push_back(p->strings[name]);
    if (!versioned) return true;
    uint8_t id = 0;
    uint64_t size = 0;
    std::string_view version;
    if (!r.Byte(&id) || id != kDialectVersions || !r.VarInt(&size) ||
        !r.Bytes(size, &version)) {
      return false;
    }
    p->opaque.push_back(version);
    return true;
  });
  uint64_t num_ops = 0, seen = 0;
  if (!ok || !r.VarInt(&num_ops)) return false;
  while (!r.empty()) {
    uint64_t dialect = 0;
    if (!r.VarInt(&dialect) || dialect >= p->dialects.size()) return false;
    ok = r.List([&] {
      uint64_t name = 0;
      bool registered = false;
      if (!r.Flagged(&name, &registered) || name >= p->strings.size()) {
        return false;
      }
      p->strings_named_elsewhere.insert(name);
      p->op_names.push_back({p->dialects[dialect], p->strings[name]});
      p->op_registered.push_back(registered);
      ++seen;
      return true;
    });
    if (!ok) return false;
  }
  return seen == num_ops;
}

bool ReadEntries(std::string_view offsets, std::string_view data, Program* p) {
  Reader r(offsets);
  uint64_t num_types = 0;
  if (!r.VarInt(&p->num_attrs) || !r.VarInt(&num_types) ||
      p->num_attrs > offsets.size() || num_types > offsets.size()) {
    return false;
  }
  size_t at = 0;
  for (uint64_t total : {p->num_attrs, num_types}) {
    uint64_t done = 0;
    while (done < total) {
      uint64_t dialect = 0, count = 0;
      if (!r.VarInt(&dialect) || dialect >= p->dialects.size() ||
          !r.VarInt(&count) || count == 0 || count > total - done) {
        return false;
      }
      p->groups += EncodeVarInt(dialect) + EncodeVarInt(count);
      for (uint64_t i = 0; i < count; ++i, ++done) {
        Entry e;
        e.is_attr = total == p->num_attrs && p->entries.size() < p->num_attrs;
        e.dialect = dialect;
        uint64_t size = 0;
        if (!r.Flagged(&size, &e.custom) || size > data.size() - at) {
          return false;
        }
        p->groups.push_back(e.custom ? 'c' : 'a');
        e.data = data.substr(at, size);
        at += size;
        p->entries.push_back(e);
      }
    }
  }
  return r.empty() && at == data.size();
}

// The layouts of the entries whose encoding is known beyond the builtin
// attributes: builtin types (mlir/IR/BuiltinDialectBytecode.td) and the vhlo
// dialect's attributes and types (stablehlo/dialect/VhloBytecode.cpp), by
// code. A an attribute, T a type, S a string (each an index), V a varint of
// data, B a blob, R data to the end, [..] a list. Codes are never reused by
// either (their tables say so); a code not here is scanned.
const char* BuiltinTypeLayout(uint64_t code) {
  static const char* const kLayouts[] = {
      "V",      "",     "[T][T]", "", "", "", "", "", "", "T", "[V]TA",
      "A[V]TA", "",     "[V]T",   "A[V]T", "[T]", "T", "AT", "T", "[V]T"};
  return code < sizeof(kLayouts) / sizeof(kLayouts[0]) ? kLayouts[code]
                                                       : nullptr;
}

const char* VhloAttrLayout(uint64_t code) {
  static const char* const kLayouts[] = {
      nullptr, "[A]", "V", "V", "V", "V", "[AA]", "V", "TR", "TR", "[V]V[V]",
      "V",     "V",   "V", "S", "TB", "V", "T",  "[V]", "V", "VVVA"};
  return code < sizeof(kLayouts) / sizeof(kLayouts[0]) ? kLayouts[code]
                                                       : nullptr;
}

const char* VhloTypeLayout(uint64_t code) {
  switch (code) {
    case 1: case 25: return "T";                // complex, unranked tensor
    case 8: return "[T][T]";                    // function
    case 20: case 41: return "[V]T";            // ranked tensor, buffer
    case 21: return "A[V]T";                    // ranked tensor, encoded
    case 23: return "[T]";                      // tuple
    case 24: return "VTTVVVV";                  // uniform quantized
    case 30: return "VTTVVV[V][V]";             // ... per axis
    default: return code <= 41 ? "" : nullptr;  // the rest have no fields
  }
}

// Reads `layout` to the end of `r`, collecting the indices it names.
bool ReadLayout(Reader& r, std::string_view layout, const Program& p,
                std::vector<uint64_t>* attrs, std::vector<uint64_t>* strings) {
  const uint64_t num_types = p.entries.size() - p.num_attrs;
  auto fields = [&](std::string_view part) {
    for (char field : part) {
      uint64_t v = 0;
      std::string_view bytes;
      bool ok = true;
      switch (field) {
        case 'A': ok = r.VarInt(&v) && v < p.num_attrs; attrs->push_back(v); break;
        case 'T': ok = r.VarInt(&v) && v < num_types; break;
        case 'S': ok = r.VarInt(&v) && v < p.strings.size(); strings->push_back(v); break;
        case 'V': ok = r.VarInt(&v); break;
        case 'B': ok = r.VarInt(&v) && r.Bytes(v, &bytes); break;
        case 'R': r.Rest(); break;
        default: return false;
      }
      if (!ok) return false;
    }
    return true;
  };
  for (size_t i = 0; i < layout.size();) {
    if (layout[i] != '[') {
      size_t end = layout.find('[', i);
      end = end == std::string_view::npos ? layout.size() : end;
      if (!fields(layout.substr(i, end - i))) return false;
      i = end;
      continue;
    }
    const size_t close = layout.find(']', i);
    const std::string_view each = layout.substr(i + 1, close - i - 1);
    if (!r.List([&] { return fields(each); })) return false;
    i = close + 1;
  }
  return r.empty();
}

// Reads a builtin type or a vhlo entry by its layout. Otherwise (another
// dialect, a code not known here, or one that does not read as its layout
// says) it is opaque: scanned for every index it could name.
void ReadOtherEntry(Entry* e, std::string_view dialect, Program* p) {
  Reader r(e->data);
  uint64_t code = 0;
  const bool builtin = dialect == "builtin", vhlo = dialect == "vhlo";
  if ((builtin || vhlo) && r.VarInt(&code)) {
    const char* layout = builtin ? BuiltinTypeLayout(code)
                         : e->is_attr ? VhloAttrLayout(code)
                                      : VhloTypeLayout(code);
    std::vector<uint64_t> attrs, strings;
    const size_t after_code = r.pos();
    if (layout != nullptr && ReadLayout(r, layout, *p, &attrs, &strings)) {
      p->attrs_named_elsewhere.insert(attrs.begin(), attrs.end());
      p->strings_named_elsewhere.insert(strings.begin(), strings.end());
      return;
    }
    e->scan_from = after_code;  // both dialects read their code first
  }
  e->opaque = true;
}

// Reads one builtin attribute's references; false if it does not parse.
bool ReadBuiltinAttr(uint64_t index, Entry* e, Program* p) {
  Reader r(e->data);
  uint64_t code = 0, v = 0, w = 0;
  if (!r.VarInt(&code)) return false;
  std::vector<uint64_t>& attrs = e->refs;  // what it names
  auto attr = [&] {
    if (!r.VarInt(&v) || v >= p->num_attrs) return false;
    attrs.push_back(v);
    return true;
  };
  auto location = [&] {  // an attribute MLIR reads as a LocationAttr
    if (!attr()) return false;
    e->must_be_locations.push_back(v);
    return true;
  };
  auto string_attr = [&] {  // one MLIR reads as a StringAttr
    if (!attr()) return false;
    e->must_be_strings.push_back(v);
    return true;
  };
  auto varint = [&] { return r.VarInt(&w); };
  auto type = [&] {
    return r.VarInt(&w) && w < p->entries.size() - p->num_attrs;
  };
  auto blob = [&] {
    std::string_view bytes;
    return r.VarInt(&w) && r.Bytes(w, &bytes);
  };
  bool exact = true;  // must end where its fields do
  bool ok = false;
  uint64_t n = 0;
  switch (code) {
    case kCallSiteLoc: ok = location() && location(); break;
    case kFileLineColLoc:
      ok = string_attr() && varint() && varint();
      if (ok) e->file_name = static_cast<int64_t>(attrs[0]);
      break;
    case kFileLineColRange:  // MLIR takes at most four lines and columns
      ok = string_attr() && r.VarInt(&n) && n <= 4;
      for (uint64_t i = 0; ok && i < n; ++i) ok = varint();
      if (ok) e->file_name = static_cast<int64_t>(attrs[0]);
      break;
    case kFusedLoc: ok = r.List(location); break;
    case kFusedLocWithMetadata: ok = r.List(location) && attr(); break;
    case kNameLoc: ok = string_attr() && location(); break;
    case kUnknownLoc: ok = true; break;
    case kArray: ok = r.List(attr); break;
    case kDictionary: ok = r.List([&] { return attr() && attr(); }); break;
    case kStringAttr:
      ok = r.VarInt(&v) && v < p->strings.size();
      if (ok) p->string_of_attr[index] = v;
      if (ok) p->string_attrs.insert(index);
      break;
    case kStringWithType:
      ok = r.VarInt(&v) && v < p->strings.size() && type();
      if (ok) p->strings_named_elsewhere.insert(v);
      if (ok) p->string_attrs.insert(index);
      break;
    case kFlatSymbolRef: ok = attr(); break;
    case kSymbolRef: ok = attr() && r.List(attr); break;
    case kTypeAttr: ok = type(); break;
    case kUnit: ok = true; break;
    case kInteger:  // the value's width is its type's: data, no references
    case kFloat: ok = type(); exact = false; break;
    case kDenseResource: ok = type() && varint(); break;
    case kDenseArray: ok = type() && varint() && blob(); break;
    case kDenseIntOrFP: ok = type() && blob(); break;
    case kDenseString: ok = true; exact = false; e->opaque = true; break;
    case kSparse: ok = type() && attr() && attr(); break;
    case kDistinct: ok = attr(); break;
    default: return false;  // a code this reader does not know
  }
  if (!ok || (exact && !r.empty())) return false;
  e->location = code == kCallSiteLoc || code == kFileLineColLoc ||
                code == kFileLineColRange || code == kFusedLoc ||
                code == kFusedLocWithMetadata || code == kNameLoc ||
                code == kUnknownLoc;
  if (!e->location) {
    p->attrs_named_elsewhere.insert(attrs.begin(), attrs.end());
    attrs.clear();
  }
  return true;
}

// Which operations own each properties blob, read from the IR section the
// way MLIR's reader walks it (BytecodeReader.cpp, version 6: parseRegions,
// parseOpWithoutRegions, parseBlockHeader); the values it names are skipped.
class IrWalk {
 public:
  explicit IrWalk(const Program& p)
      : p_(p), owners_(p.properties.size()) {}

  // The owners by blob, or false if the section does not read as expected.
  bool Run(std::string_view ir, std::vector<std::set<uint64_t>>* owners) {
    Reader r(ir);
    if (!Block(r, 0) || !r.empty()) return false;
    *owners = std::move(owners_);
    return true;
  }

 private:
  static constexpr int kMaxDepth = 256;

  bool UseListOrders(Reader& r, uint64_t num_values) {
    uint64_t n = 1, v = 0;
    if (num_values > 1 && !r.VarInt(&n)) return false;
    for (uint64_t i = 0; i < n; ++i) {
      uint64_t count = 0;
      bool pairs = false;
      if ((num_values > 1 && !r.VarInt(&v)) || !r.Flagged(&count, &pairs) ||
          count > r.size()) {
        return false;
      }
      for (uint64_t k = 0; k < count; ++k) {
        if (!r.VarInt(&v)) return false;
      }
    }
    return true;
  }

  bool Block(Reader& r, int depth) {
    uint64_t ops = 0, v = 0;
    bool has_args = false;
    if (!r.Flagged(&ops, &has_args)) return false;
    if (has_args) {
      uint64_t args = 0;
      uint8_t has_orders = 0;
      if (!r.VarInt(&args) || args > r.size()) return false;
      for (uint64_t i = 0; i < args; ++i) {
        bool has_location = false;
        if (!r.Flagged(&v, &has_location)) return false;
        if (has_location && !r.VarInt(&v)) return false;
      }
      if (!r.Byte(&has_orders)) return false;
      if (has_orders && !UseListOrders(r, args)) return false;
    }
    for (uint64_t i = 0; i < ops; ++i) {
      if (!Op(r, depth)) return false;
    }
    return true;
  }

  bool Region(Reader& r, int depth) {
    uint64_t blocks = 0, values = 0;
    if (!r.VarInt(&blocks)) return false;
    if (blocks == 0) return true;
    if (!r.VarInt(&values) || blocks > r.size()) return false;
    for (uint64_t i = 0; i < blocks; ++i) {
      if (!Block(r, depth)) return false;
    }
    return true;
  }

  // Reads `n` varints (types, values, blocks).
  static bool Skip(Reader& r, uint64_t* n) {
    uint64_t v = 0;
    if (!r.VarInt(n) || *n > r.size()) return false;
    for (uint64_t i = 0; i < *n; ++i) {
      if (!r.VarInt(&v)) return false;
    }
    return true;
  }

  bool Op(Reader& r, int depth) {
    enum : uint8_t { kAttrs = 1, kResults = 2, kOperands = 4, kSuccessors = 8,
                     kRegions = 16, kUseListOrders = 32, kProperties = 64 };
    uint64_t name = 0, v = 0, results = 0, n = 0;
    uint8_t mask = 0;
    if (!r.VarInt(&name) || name >= p_.op_names.size() || !r.Byte(&mask) ||
        (mask & 0x80) || !r.VarInt(&v)) {  // the location
      return false;
    }
    if ((mask & kAttrs) && !r.VarInt(&v)) return false;
    if (mask & kProperties) {
      if (!r.VarInt(&v) || v >= owners_.size()) return false;
      // An unregistered op's blob is one attribute: no layout known here.
      owners_[v].insert(p_.op_registered[name] ? name : UINT64_MAX);
    }
    if ((mask & kResults) && !Skip(r, &results)) return false;
    if ((mask & kOperands) && !Skip(r, &n)) return false;
    if ((mask & kSuccessors) && !Skip(r, &n)) return false;
    if ((mask & kUseListOrders) && !UseListOrders(r, results)) return false;
    if (!(mask & kRegions)) return true;
    uint64_t regions = 0;
    bool isolated = false;
    if (depth >= kMaxDepth || !r.Flagged(&regions, &isolated) ||
        regions > r.size()) {
      return false;
    }
    if (regions == 0) return true;
    if (!isolated) {
      for (uint64_t i = 0; i < regions; ++i) {
        if (!Region(r, depth + 1)) return false;
      }
      return true;
    }
    // An isolated op's regions are a nested IR section (for lazy loading).
    uint8_t id = 0;
    uint64_t size = 0;
    std::string_view data;
    if (!r.Byte(&id) || id != kIR || !r.VarInt(&size) || !r.Bytes(size, &data)) {
      return false;
    }
    Reader nested(data);
    for (uint64_t i = 0; i < regions; ++i) {
      if (!Region(nested, depth + 1)) return false;
    }
    return nested.empty();
  }

  const Program& p_;
  std::vector<std::set<uint64_t>> owners_;
};

// What each op's properties name, by the op that owns them (ODS's generated
// readProperties reads each attribute in turn: required ones plain,
// optional ones flagged). builtin.module: its optional sym_name and
// sym_visibility; a vhlo op: only attributes, all required (the VHLO
// dialect's design: VHLO_AnyAttr for every attribute, no optional one). A
// blob of another op, or one the walk could not place, is scanned.
bool ReadOwnedProperties(Reader& r, std::string_view dialect,
                         std::string_view name, const Program& p,
                         std::vector<uint64_t>* attrs) {
  uint64_t v = 0;
  if (dialect == "builtin" && name == "module") {
    for (int i = 0; i < 2; ++i) {
      bool present = false;
      if (!r.Flagged(&v, &present) || (present && v >= p.num_attrs)) {
        return false;
      }
      if (present) attrs->push_back(v);
    }
    return r.empty();
  }
  if (dialect != "vhlo") return false;
  while (!r.empty()) {
    if (!r.VarInt(&v) || v >= p.num_attrs) return false;
    attrs->push_back(v);
  }
  return true;
}

void ReadProperties(Program* p) {
  std::vector<std::set<uint64_t>> owners;
  const bool placed = p->properties.empty() ||
                      IrWalk(*p).Run(p->sections[kIR].second, &owners);
  for (size_t i = 0; i < p->properties.size(); ++i) {
    std::vector<uint64_t> attrs;
    bool known = placed && !owners[i].empty();
    for (uint64_t op : placed ? owners[i] : std::set<uint64_t>()) {
      Reader r(p->properties[i]);
      known = known && op != UINT64_MAX &&
              ReadOwnedProperties(r, p->op_names[op].first,
                                  p->op_names[op].second, *p, &attrs);
    }
    if (known) {
      p->attrs_named_elsewhere.insert(attrs.begin(), attrs.end());
    } else {
      p->opaque.push_back(p->properties[i]);
    }
  }
}

// Whether locations name each other in a circle: MLIR's reader, resolving
// an attribute's references before the attribute, recurses without end (and
// crashes) on such a program, which must not share a key with one it reads.
bool LocationCycle(const Program& p) {
  enum Mark : uint8_t { kNew, kOpen, kDone };
  std::vector<uint8_t> mark(p.entries.size(), kNew);
  std::vector<std::pair<uint64_t, size_t>> stack;  // (entry, next reference)
  for (uint64_t root = 0; root < p.entries.size(); ++root) {
    if (!p.entries[root].location || mark[root] != kNew) continue;
    stack.push_back({root, 0});
    mark[root] = kOpen;
    while (!stack.empty()) {
      auto& [at, next] = stack.back();
      const std::vector<uint64_t>& refs = p.entries[at].refs;
      if (next == refs.size()) {
        mark[at] = kDone;
        stack.pop_back();
        continue;
      }
      const uint64_t to = refs[next++];
      if (!p.entries[to].location) continue;
      if (mark[to] == kOpen) return true;
      if (mark[to] == kNew) {
        mark[to] = kOpen;
        stack.push_back({to, 0});
      }
    }
  }
  return false;
}

bool ReadProgram(std::string_view bytes, Program* p, std::string* header) {
  Reader r(bytes);
  std::string_view magic, producer;
  uint64_t version = 0;
  if (!r.Bytes(4, &magic) || magic != std::string_view("ML\xefR", 4) ||
      !r.VarInt(&version) || version != 6 || !r.CString(&producer)) {
    return false;  // version 6 is the layout read here (LLVM 19 to 21)
  }
  Put(version, header);
  PutBytes(producer, header);
  while (!r.empty()) {
    uint8_t id = 0;
    uint64_t size = 0, align = 1;
    std::string_view data;
    if (!r.Byte(&id) || !r.VarInt(&size)) return false;
    if (id & 0x80) {
      if (!r.VarInt(&align) || align == 0 || (align & (align - 1)) ||
          align > 4096) {
        return false;
      }
      while (r.pos() % align) {  // aligned within the program, as written
        uint8_t pad = 0;
        if (!r.Byte(&pad) || pad != 0xCB) return false;
      }
    }
    id &= 0x7f;
    if (id > kProperties || id == kDialectVersions || p->sections.count(id) ||
        !r.Bytes(size, &data)) {
      return false;
    }
    p->sections[id] = {align, data};
    p->order.push_back(id);
  }
  for (uint8_t id : {kString, kDialect, kAttrType, kAttrTypeOffset, kIR}) {
    if (!p->sections.count(id)) return false;
  }
  if (!ReadStrings(p->sections[kString].second, p) ||
      !ReadDialects(p->sections[kDialect].second, p) ||
      !ReadEntries(p->sections[kAttrTypeOffset].second,
                   p->sections[kAttrType].second, p)) {
    return false;
  }
  for (size_t i = 0; i < p->entries.size(); ++i) {
    Entry& e = p->entries[i];
    std::string_view dialect = p->dialects[e.dialect];
    if (!e.custom) {  // text, NUL-terminated: names nothing by index
      if (e.data.empty() || e.data.back() != '\0') return false;
    } else if (e.is_attr && dialect == "builtin") {
      if (!ReadBuiltinAttr(i, &e, p)) return false;
    } else {
      ReadOtherEntry(&e, dialect, p);
    }
  }
  // What a location names must be what MLIR reads there.
  for (const Entry& e : p->entries) {
    for (uint64_t a : e.must_be_locations) {
      const Entry& l = p->entries[a];
      const bool text_location = !l.custom &&
                                 p->dialects[l.dialect] == "builtin" &&
                                 l.data.substr(0, 4) == "loc(";
      if (!l.location && !text_location) return false;
    }
    for (uint64_t a : e.must_be_strings) {
      if (!p->string_attrs.count(a)) return false;
    }
  }
  if (LocationCycle(*p)) return false;
  // Properties: a count, then each op's blob, encoded by its dialect.
  if (p->sections.count(kProperties)) {
    Reader props(p->sections[kProperties].second);
    bool ok = props.List([&] {
      uint64_t n = 0;
      std::string_view blob;
      if (!props.VarInt(&n) || !props.Bytes(n, &blob)) return false;
      p->properties.push_back(blob);
      return true;
    });
    if (!ok || !props.empty()) return false;
  }
  ReadProperties(p);
  // The resource offsets name resource keys (strings); no resources at all
  // (a count of zero groups, as jax writes) names nothing.
  if (p->sections.count(kResourceOffset) &&
      p->sections[kResourceOffset].second != std::string_view("\x01", 1)) {
    p->opaque.push_back(p->sections[kResourceOffset].second);
  }
  return true;
}

// Every value < `limit` that a varint starting at some byte of the opaque
// pieces decodes to. Whatever a dialect's reader reads from a piece, an index
// it names is a varint that starts at some offset, in whichever of its
// encodings (MLIR's reader accepts every length), and the first byte alone
// says how long the varint there is: so the value decoded at each offset is
// every value any reader can read from the piece. An index absent from this
// set, plain or flagged (2 * index + 1, an optional reference), is named by
// no opaque piece, by proof rather than by search for one spelling.
std::vector<bool> OpaqueValues(const Program& p, uint64_t limit) {
  std::vector<bool> held(limit, false);
  auto scan = [&](std::string_view piece) {
    for (size_t i = 0; i < piece.size(); ++i) {
      const size_t n = VarIntLength(static_cast<uint8_t>(piece[i]));
      if (piece.size() - i < n) continue;
      const uint64_t value = DecodeVarInt(piece.data() + i, n);
      if (value < limit) held[value] = true;
    }
  };
  for (const Entry& e : p.entries) {
    if (e.opaque) scan(e.data.substr(e.scan_from));
  }
  for (std::string_view piece : p.opaque) scan(piece);
  return held;
}

// What the canonical form leaves out: the locations that nothing but
// locations reaches, and the strings that only their file names name.
struct Dropped {
  std::vector<bool> locations;  // by entry
  std::set<uint64_t> strings;
};

Dropped Droppable(const Program& p) {
  const uint64_t limit =
      2 * std::max<uint64_t>(p.entries.size(), p.strings.size()) + 2;
  const std::vector<bool> held = OpaqueValues(p, limit);
  auto named_by_opaque = [&](uint64_t index) {
    return held[index] || held[2 * index + 1];
  };
  // An attribute a non-location names (a builtin attribute's field, any
  // opaque piece) is meaning, and so is everything a location reaches from
  // it: those locations stay, and all they name.
  std::vector<bool> semantic(p.entries.size(), false);
  std::vector<uint64_t> work;
  for (uint64_t a = 0; a < p.num_attrs; ++a) {
    if (p.attrs_named_elsewhere.count(a) || named_by_opaque(a)) {
      semantic[a] = true;
      work.push_back(a);
    }
  }
  while (!work.empty()) {
    const Entry& e = p.entries[work.back()];
    work.pop_back();
    for (uint64_t a : e.refs) {  // empty but for locations
      if (!semantic[a]) {
        semantic[a] = true;
        work.push_back(a);
      }
    }
  }
  Dropped out;
  out.locations.resize(p.entries.size(), false);
  std::set<uint64_t> file_names;  // StringAttrs only dropped locations name
  for (size_t i = 0; i < p.entries.size(); ++i) {
    const Entry& e = p.entries[i];
    if (!e.location || semantic[i]) continue;
    out.locations[i] = true;
    if (e.file_name >= 0 && !semantic[e.file_name] &&
        p.string_of_attr.count(e.file_name)) {
      file_names.insert(static_cast<uint64_t>(e.file_name));
    }
  }
  for (const auto& [attr, string] : p.string_of_attr) {
    if (file_names.count(attr)) out.strings.insert(string);
  }
  for (const auto& [attr, string] : p.string_of_attr) {
    if (!file_names.count(attr)) out.strings.erase(string);  // not a file name
  }
  for (auto it = out.strings.begin(); it != out.strings.end();) {
    const bool named =
        p.strings_named_elsewhere.count(*it) > 0 || named_by_opaque(*it);
    it = named ? out.strings.erase(it) : std::next(it);
  }
  return out;
}

}  // namespace

std::optional<std::string> CanonicalMlirBytecode(std::string_view bytes) {
  Program p;
  std::string out("\0xlakit-mlir-canon/2\0", 21);
  if (!ReadProgram(bytes, &p, &out)) return std::nullopt;
  const Dropped dropped = Droppable(p);
  for (uint8_t id : p.order) {
    const auto& [align, data] = p.sections.at(id);
    out.push_back(char(id));
    Put(align, &out);
    std::string body;
    if (id == kString) {
      Put(p.strings.size(), &body);
      for (size_t i = 0; i < p.strings.size(); ++i) {
        const bool file_name = dropped.strings.count(i) > 0;
        body.push_back(file_name ? 'F' : 'S');
        if (!file_name) PutBytes(p.strings[i], &body);
      }
    } else if (id == kAttrTypeOffset) {
      Put(p.num_attrs, &body);
      Put(p.entries.size() - p.num_attrs, &body);
      body += p.groups;
    } else if (id == kAttrType) {
      for (size_t i = 0; i < p.entries.size(); ++i) {
        body.push_back(dropped.locations[i] ? 'L' : 'E');
        if (!dropped.locations[i]) PutBytes(p.entries[i].data, &body);
      }
    } else {
      body = std::string(data);
    }
    PutBytes(body, &out);
  }
  return out;
}

}  // namespace pjrt_wrap
}  // namespace xlakit
