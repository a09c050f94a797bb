// Canonical bytes of an MLIR bytecode program with its source locations
// neutralised, so that a jax function moved down its script, or the same
// script run from another folder, keys the same cache entry.
//
// jax sends programs as MLIR bytecode (a StableHLO portable artifact: the
// builtin and vhlo dialects) whose location attributes carry the script's
// path, lines and columns. JAX's own cache strips them with MLIR's
// strip-debuginfo pass; the wrapper has no MLIR, so this reads the bytecode
// container itself (https://mlir.llvm.org/docs/BytecodeFormat/, version 6)
// and writes a canonical form:
//   * the header (version, producer) and every section other than the string,
//     attribute/type and attribute/type offset sections, byte for byte;
//   * every attribute and type entry, each framed by its length, its dialect
//     and encoding kept; a builtin location entry (CallSiteLoc,
//     FileLineColLoc, FileLineColRange, FusedLoc, NameLoc, UnknownLoc, custom
//     or text encoded) becomes one fixed marker: its lines, columns and the
//     attributes it names are out;
//   * every string, framed by its length, except a file name: a string that
//     only builtin StringAttrs name, each of them named only by locations.
//     The proof that nothing else names it: the dialect section and the
//     builtin attributes are read; every other piece (other dialects' entries,
//     types, properties, resources, dialect versions) must not hold the
//     string's index as a varint anywhere (a false alarm keeps the string: a
//     miss). One assumption: in a StableHLO portable artifact (producer
//     "StableHLO_v...") vhlo attributes and types hold only vhlo ones
//     (stablehlo's VHLO verifiers), so they cannot name a builtin StringAttr.
// Anything not read exactly as expected gives nullopt (the caller keys the
// bytes as they are: a possible miss, never a wrong hit). MLIR text is not
// bytecode: nullopt.
#ifndef XLAKIT_PJRT_WRAP_MLIR_BYTECODE_H_
#define XLAKIT_PJRT_WRAP_MLIR_BYTECODE_H_

#include <optional>
#include <string>
#include <string_view>

namespace xlakit {
namespace pjrt_wrap {

// The canonical form (it starts with a NUL, which neither MLIR text nor
// bytecode does), or nullopt.
std::optional<std::string> CanonicalMlirBytecode(std::string_view bytes);

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_MLIR_BYTECODE_H_
