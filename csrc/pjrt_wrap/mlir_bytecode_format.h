// The MLIR bytecode container as mlir_bytecode.cc reads it (internal to
// pjrt_wrap): section and builtin attribute codes, MLIR's prefix varints, a
// reader of them, and a program's strings, dialects and attribute/type
// entries with what each names. Read by mlir_bytecode.cc (the container and
// the canonical form), mlir_bytecode_dialects.cc (entries of known dialects)
// and mlir_bytecode_ir.cc (the IR section, for op properties).
#ifndef XLAKIT_PJRT_WRAP_MLIR_BYTECODE_FORMAT_H_
#define XLAKIT_PJRT_WRAP_MLIR_BYTECODE_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace xlakit {
namespace pjrt_wrap {
namespace mlir_bytecode {

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
inline size_t VarIntLength(uint8_t first) {
  if (first == 0) return 9;
  size_t n = 1;
  while (!(first & (1u << (n - 1)))) ++n;
  return n;
}

// The value of the `n`-byte varint at `p`.
inline uint64_t DecodeVarInt(const char* p, size_t n) {
  uint64_t value = 0;
  if (n == 9) {
    for (size_t i = 0; i < 8; ++i) value |= uint64_t(uint8_t(p[1 + i])) << (8 * i);
    return value;
  }
  for (size_t i = 0; i < n; ++i) value |= uint64_t(uint8_t(p[i])) << (8 * i);
  return value >> n;
}

// The length of the shortest encoding of `value` (what MLIR's writer emits).
inline size_t VarIntSize(uint64_t value) {
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
inline std::string EncodeVarInt(uint64_t value) {
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

inline void Put(uint64_t value, std::string* out) {  // fixed 8 bytes, little endian
  for (int i = 0; i < 8; ++i) out->push_back(char(value >> (8 * i)));
}

inline void PutBytes(std::string_view bytes, std::string* out) {
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

// Reads a builtin type or a vhlo entry by its layout, recording what it
// names in `p`; any other entry is marked opaque (mlir_bytecode_dialects.cc).
void ReadOtherEntry(Entry* e, std::string_view dialect, Program* p);

// Reads one builtin attribute's references; false if it does not parse
// (mlir_bytecode_dialects.cc).
bool ReadBuiltinAttr(uint64_t index, Entry* e, Program* p);

// What each op's properties name, by the op that owns them; a blob it
// cannot place is left opaque (mlir_bytecode_ir.cc).
void ReadProperties(Program* p);

}  // namespace mlir_bytecode
}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_MLIR_BYTECODE_FORMAT_H_
