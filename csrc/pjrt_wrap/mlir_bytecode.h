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
//     FileLineColLoc, FileLineColRange, FusedLoc, NameLoc, UnknownLoc) that
//     nothing but locations reaches becomes one fixed marker: its lines,
//     columns and the attributes it names are out;
//   * every string, framed by its length, except a file name: a string that
//     only builtin StringAttrs name, each of them named only by the dropped
//     locations' file names.
// Only what is proven equivalent is left out. "Nothing else names it" is read,
// not guessed: the builtin attributes and types, the vhlo dialect's
// attributes and types (its bytecode tables), the dialect section and the
// properties of builtin.module and of vhlo ops (their owners found by walking
// the IR section) are parsed, so every index they name is known; anything
// else (another dialect's entry, an unknown code, dialect versions, other
// properties, resource keys) is opaque, and an index counts as named by it
// if a varint at any of its offsets decodes to the index, plain or as an
// optional reference (2 * index + 1). Since the first byte of a varint says
// its length, that covers every spelling of every index MLIR's reader could
// read there (a false alarm keeps the string or the location: a miss).
// Varints read here must have their shortest spelling (MLIR's writer's), and
// what MLIR reads as a location or a StringAttr must be one, with no
// locations naming each other in a circle (MLIR's reader never ends on
// those): a program MLIR would refuse never gets the key of one it reads.
// Anything not read exactly as expected gives nullopt (the caller keys the
// bytes as they are: a possible miss, never a wrong hit). MLIR text is not
// bytecode: nullopt. Tested against jaxlib's own reading
// (tests/runtime/test_key_differential.py).
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
