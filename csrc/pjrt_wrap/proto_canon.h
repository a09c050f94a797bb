// Canonical bytes of the protobufs a cache key covers.
//
// Protobuf leaves the order of a map's entries unspecified, and XLA's C++
// writes them in hash order, which differs from process to process: jax's
// serialized CompileOptionsProto carries DebugOptions maps whose entries
// change places on every start, so the raw bytes never hit after a restart.
// The canonical form sorts the entries of the map fields named below (by
// their key) and keeps everything else byte for byte. Only fields known to be
// maps are reordered: reordering anything else could make two different
// programs one key, which must never happen. A map's key is read as protobuf
// reads it, and only from a plain entry (one key of the key's wire type, one
// value, each tag in its shortest spelling, an integer key too, nothing
// else); any other entry, a map with a key twice (protobuf keeps the last,
// which a sort would move), a message whose length is written again from a
// longer spelling, or unparsable input, returns the input unchanged (a
// possible miss, never a wrong hit).
// An HLO module also loses its debug metadata (each instruction's OpMetadata
// op type and name, source file, lines, columns and stack frame id, and the
// module's stack_frame_index): they never change the executable, and with
// torch_xla's XLA_HLO_DEBUG=1 they change with every line added above an op.
// A field is left out only with its own wire type, its tag's shortest
// spelling and contents a proto3 parser takes (UTF-8 strings): otherwise it
// is another (unknown) field, or makes the module one XLA refuses, and stays.
// MLIR bytecode (jax) loses its locations too, read without MLIR
// (mlir_bytecode.h). Tested against protobuf's own parser
// (tests/runtime/test_key_differential.py).
//
// Field numbers are XLA's (xla/pjrt/proto/compile_options.proto,
// xla/xla.proto, xla/service/hlo.proto, xla/xla_data.proto); fields never
// change number, and a map added by a later XLA only costs misses.
#ifndef XLAKIT_PJRT_WRAP_PROTO_CANON_H_
#define XLAKIT_PJRT_WRAP_PROTO_CANON_H_

#include <string>
#include <string_view>

namespace xlakit {
namespace pjrt_wrap {

// A serialized xla.CompileOptionsProto.
std::string CanonicalCompileOptions(std::string_view bytes);

// A program of `format` ("hlo": a serialized xla.HloModuleProto, maps
// sorted and source locations dropped; "mlir" bytecode: its canonical form
// without locations, mlir_bytecode.h; anything else, or input that does not
// read as expected, returned as it is).
std::string CanonicalProgram(std::string_view format, std::string_view bytes);

// What the canonical HLO program would be with every constant's literal
// cleared (the instructions stay): equal for two programs that differ only in
// the values of their constants, such as a Python number baked into a graph.
// Recorded beside an entry to explain misses (key_record.h), never keyed.
// "" for other formats, or HLO that does not parse.
std::string ProgramWithoutConstants(std::string_view format,
                                    std::string_view bytes);

// The program's module name, printable: an HLO module's name; for MLIR, the
// `module @name` of text or, in bytecode, the first string named like jax's
// modules (jit_...), a cheap guess; else "unknown".
std::string ModuleName(std::string_view format, std::string_view bytes);

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_PROTO_CANON_H_
