// Canonical MLIR bytecode with locations neutralised; see mlir_bytecode.h.
// The container (sections, strings, dialects, the attribute/type table), the
// proof of what only locations name, and the canonical form; the entries of
// known dialects are read in mlir_bytecode_dialects.cc, op properties in
// mlir_bytecode_ir.cc.
#include "pjrt_wrap/mlir_bytecode.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "pjrt_wrap/mlir_bytecode_format.h"

namespace xlakit {
namespace pjrt_wrap {
namespace mlir_bytecode {
namespace {

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
        p->entries.push_back(std::move(e));
      }
    }
  }
  return r.empty() && at == data.size();
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

std::optional<std::string> Canonical(std::string_view bytes) {
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

}  // namespace
}  // namespace mlir_bytecode

std::optional<std::string> CanonicalMlirBytecode(std::string_view bytes) {
  return mlir_bytecode::Canonical(bytes);
}

}  // namespace pjrt_wrap
}  // namespace xlakit
