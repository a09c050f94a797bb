// The IR section of MLIR bytecode walked far enough to know which operation
// owns each properties blob, and what the owners' properties name (builtin.
// module's and vhlo ops'); see mlir_bytecode.h.
#include <cstdint>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "pjrt_wrap/mlir_bytecode_format.h"

namespace xlakit {
namespace pjrt_wrap {
namespace mlir_bytecode {
namespace {

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

}  // namespace

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

}  // namespace mlir_bytecode
}  // namespace pjrt_wrap
}  // namespace xlakit
