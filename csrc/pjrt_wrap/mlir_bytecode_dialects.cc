// The entries of dialects whose bytecode mlir_bytecode.cc knows: the builtin
// attributes (their references, and what a location must name) and, by the
// layout tables below, builtin types and the vhlo dialect's attributes and
// types; see mlir_bytecode.h for why each index they name is known.
#include <cstdint>
#include <string_view>
#include <vector>

#include "pjrt_wrap/mlir_bytecode_format.h"

namespace xlakit {
namespace pjrt_wrap {
namespace mlir_bytecode {
namespace {

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

}  // namespace

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

}  // namespace mlir_bytecode
}  // namespace pjrt_wrap
}  // namespace xlakit
