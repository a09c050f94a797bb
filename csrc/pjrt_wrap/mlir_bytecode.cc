// Canonical MLIR bytecode with locations neutralised; see mlir_bytecode.h.
#include "pjrt_wrap/mlir_bytecode.h"

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

class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  bool empty() const { return pos_ == data_.size(); }
  size_t pos() const { return pos_; }
  // MLIR's prefix varint: the first byte's trailing zeros say how many more
  // bytes follow (0x00: eight).
  bool VarInt(uint64_t* out) {
    if (pos_ >= data_.size()) return false;
    uint8_t first = static_cast<uint8_t>(data_[pos_]);
    size_t n = 9;
    if (first != 0) {
      n = 1;
      while (!(first & (1u << (n - 1)))) ++n;
    }
    if (data_.size() - pos_ < n) return false;
    uint64_t value = 0;
    if (n == 9) {
      for (size_t i = 0; i < 8; ++i) {
        value |= uint64_t(uint8_t(data_[pos_ + 1 + i])) << (8 * i);
      }
    } else {
      for (size_t i = 0; i < n; ++i) {
        value |= uint64_t(uint8_t(data_[pos_ + i])) << (8 * i);
      }
      value >>= n;
    }
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

// The encodings of `value` as an MLIR varint (the writer's shortest form).
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
  bool location = false;
  bool opaque = false;         // references unknown: scanned
  bool vhlo_invariant = false;  // a vhlo entry of a portable artifact
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
  std::set<uint64_t> attrs_named_elsewhere;    // by a builtin non-location
  std::set<uint64_t> file_names;               // a location's file name attr
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

// Reads one builtin attribute's references; false if it does not parse.
bool ReadBuiltinAttr(uint64_t index, Entry* e, Program* p) {
  Reader r(e->data);
  uint64_t code = 0, v = 0, w = 0;
  if (!r.VarInt(&code)) return false;
  std::vector<uint64_t> attrs;  // what it names
  auto attr = [&] {
    if (!r.VarInt(&v) || v >= p->num_attrs) return false;
    attrs.push_back(v);
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
  switch (code) {
    case kCallSiteLoc: ok = attr() && attr(); break;
    case kFileLineColLoc:
      ok = attr() && varint() && varint();
      if (ok) p->file_names.insert(attrs[0]);
      break;
    case kFileLineColRange:
      ok = attr() && r.List(varint);
      if (ok) p->file_names.insert(attrs[0]);
      break;
    case kFusedLoc: ok = r.List(attr); break;
    case kFusedLocWithMetadata: ok = r.List(attr) && attr(); break;
    case kNameLoc: ok = attr() && attr(); break;
    case kUnknownLoc: ok = true; break;
    case kArray: ok = r.List(attr); break;
    case kDictionary: ok = r.List([&] { return attr() && attr(); }); break;
    case kStringAttr:
      ok = r.VarInt(&v) && v < p->strings.size();
      if (ok) p->string_of_attr[index] = v;
      break;
    case kStringWithType:
      ok = r.VarInt(&v) && v < p->strings.size() && type();
      if (ok) p->strings_named_elsewhere.insert(v);
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
  if (!e->location) p->attrs_named_elsewhere.insert(attrs.begin(), attrs.end());
  return true;
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
  bool portable = producer.substr(0, 11) == "StableHLO_v";
  for (size_t i = 0; i < p->entries.size(); ++i) {
    Entry& e = p->entries[i];
    std::string_view dialect = p->dialects[e.dialect];
    if (!e.custom) {  // text, NUL-terminated: names nothing by index
      if (e.data.empty() || e.data.back() != '\0') return false;
      e.location = e.is_attr && dialect == "builtin" &&
                   e.data.substr(0, 4) == "loc(";
    } else if (e.is_attr && dialect == "builtin") {
      if (!ReadBuiltinAttr(i, &e, p)) return false;
    } else {
      e.opaque = true;
      e.vhlo_invariant = portable && dialect == "vhlo";
    }
  }
  // Properties: a count, then each op's blob, encoded by its dialect.
  if (p->sections.count(kProperties)) {
    Reader props(p->sections[kProperties].second);
    bool ok = props.List([&] {
      uint64_t n = 0;
      std::string_view blob;
      if (!props.VarInt(&n) || !props.Bytes(n, &blob)) return false;
      p->opaque.push_back(blob);
      return true;
    });
    if (!ok || !props.empty()) return false;
  }
  if (p->sections.count(kResourceOffset)) {
    p->opaque.push_back(p->sections[kResourceOffset].second);
  }
  return true;
}

bool Holds(std::string_view piece, uint64_t value) {
  return piece.find(EncodeVarInt(value)) != std::string_view::npos;
}

// The strings that only locations name, through StringAttrs only they name.
std::set<uint64_t> FileNameStrings(const Program& p) {
  std::set<uint64_t> attrs;
  for (uint64_t f : p.file_names) {
    if (!p.string_of_attr.count(f) || p.attrs_named_elsewhere.count(f)) continue;
    bool named = false;
    for (size_t i = 0; i < p.entries.size() && !named; ++i) {
      const Entry& e = p.entries[i];
      named = e.opaque && !e.vhlo_invariant &&
              (Holds(e.data, f) || Holds(e.data, 2 * f + 1));
    }
    for (size_t i = 0; i < p.opaque.size() && !named; ++i) {
      named = Holds(p.opaque[i], f) || Holds(p.opaque[i], 2 * f + 1);
    }
    if (!named) attrs.insert(f);
  }
  std::set<uint64_t> out;
  for (const auto& [attr, string] : p.string_of_attr) {
    if (attrs.count(attr)) out.insert(string);
  }
  for (const auto& [attr, string] : p.string_of_attr) {
    if (!attrs.count(attr)) out.erase(string);  // a StringAttr that is not a file name
  }
  for (auto it = out.begin(); it != out.end();) {
    bool named = p.strings_named_elsewhere.count(*it) > 0;
    for (const Entry& e : p.entries) named = named || (e.opaque && Holds(e.data, *it));
    for (std::string_view piece : p.opaque) named = named || Holds(piece, *it);
    it = named ? out.erase(it) : std::next(it);
  }
  return out;
}

}  // namespace

std::optional<std::string> CanonicalMlirBytecode(std::string_view bytes) {
  Program p;
  std::string out("\0xlakit-mlir-canon/1\0", 21);
  if (!ReadProgram(bytes, &p, &out)) return std::nullopt;
  std::set<uint64_t> dropped = FileNameStrings(p);
  for (uint8_t id : p.order) {
    const auto& [align, data] = p.sections.at(id);
    out.push_back(char(id));
    Put(align, &out);
    std::string body;
    if (id == kString) {
      Put(p.strings.size(), &body);
      for (size_t i = 0; i < p.strings.size(); ++i) {
        body.push_back(dropped.count(i) ? 'F' : 'S');
        if (!dropped.count(i)) PutBytes(p.strings[i], &body);
      }
    } else if (id == kAttrTypeOffset) {
      Put(p.num_attrs, &body);
      Put(p.entries.size() - p.num_attrs, &body);
      body += p.groups;
    } else if (id == kAttrType) {
      for (const Entry& e : p.entries) {
        body.push_back(e.location ? 'L' : 'E');
        if (!e.location) PutBytes(e.data, &body);
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
