"""What a program means, as its own parsers read it: the oracles of the cache key's differential test.

* MLIR: jaxlib's MLIR bindings deserialize the StableHLO portable artifact (as a PJRT plugin does: VHLO to
  StableHLO) and print the module without debug information, so locations are out (an attribute whose value
  is a location still prints). A malformed program can abort MLIR (llvm::report_fatal_error), so this runs in
  a worker process (`MlirOracle`), started again after a crash; a crash counts as a failure to parse.
* HLO: no `xla_pb2` is installed here (jaxlib and torch_xla ship none), so `hlo_module_class()` builds an
  HloModuleProto class with protobuf's own descriptors, declaring the fields the key treats specially (the
  path to each instruction's metadata, the frontend attribute and schedule maps, the stack frame index, as
  in xla/service/hlo.proto and xla/xla_data.proto, proto3); every other field stays an unknown field that
  protobuf keeps as written. `hlo_meaning()` parses with protobuf (last map entry wins, long tags taken,
  proto3 strings checked for UTF-8), clears the fields the key leaves out, and serializes deterministically.
"""

from __future__ import annotations

import functools
import select
import struct
import subprocess
import sys

# -- HLO ----------------------------------------------------------------------------------------------------

# OpMetadata fields the key leaves out (csrc/pjrt_wrap/proto_canon.cc), and the module's stack_frame_index.
IGNORED_METADATA = ("op_type", "op_name", "source_file", "source_line", "stack_frame_id", "source_end_line",
                    "source_column", "source_end_column")


@functools.lru_cache(maxsize=None)
def hlo_module_class():
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="xlakit_test_hlo.proto", package="xlakit_test", syntax="proto3")

    def message(name, fields, nested=()):
        return _fill(fdp.message_type.add(name=name), fields, nested)

    def _fill(m, fields, nested):
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name
        for sub in nested:
            sub(m)
        return m

    def entry(key_type, value_type, value_type_name=""):
        def add(m):
            e = m.nested_type.add(name="MapEntry")
            e.options.map_entry = True
            _fill(e, [("key", 1, key_type, F.LABEL_OPTIONAL, ""),
                      ("value", 2, value_type, F.LABEL_OPTIONAL, value_type_name)], ())
        return add

    opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    message("FrontendAttributes", [("map", 1, F.TYPE_MESSAGE, rep, ".xlakit_test.FrontendAttributes.MapEntry")],
            [entry(F.TYPE_STRING, F.TYPE_STRING)])
    message("OpMetadata", [("op_type", 1, F.TYPE_STRING, opt, ""), ("op_name", 2, F.TYPE_STRING, opt, ""),
                           ("source_file", 3, F.TYPE_STRING, opt, ""), ("source_line", 4, F.TYPE_INT32, opt, ""),
                           ("deduplicated_name", 12, F.TYPE_STRING, opt, ""),
                           ("preserve_layout", 13, F.TYPE_BOOL, opt, ""),
                           ("stack_frame_id", 15, F.TYPE_INT32, opt, ""),
                           ("scheduling_name", 16, F.TYPE_STRING, opt, ""),
                           ("source_end_line", 17, F.TYPE_INT32, opt, ""),
                           ("source_column", 18, F.TYPE_INT32, opt, ""),
                           ("source_end_column", 19, F.TYPE_INT32, opt, "")])
    message("HloInstructionProto", [("metadata", 7, F.TYPE_MESSAGE, opt, ".xlakit_test.OpMetadata"),
                                    ("frontend_attributes", 68, F.TYPE_MESSAGE, opt,
                                     ".xlakit_test.FrontendAttributes")])
    message("HloComputationProto", [("instructions", 2, F.TYPE_MESSAGE, rep, ".xlakit_test.HloInstructionProto")])
    message("InstructionSequence", [("instruction_ids", 1, F.TYPE_INT64, rep, "")])
    message("HloScheduleProto", [("sequences", 1, F.TYPE_MESSAGE, rep, ".xlakit_test.HloScheduleProto.MapEntry")],
            [entry(F.TYPE_INT64, F.TYPE_MESSAGE, ".xlakit_test.InstructionSequence")])
    message("StackFrameIndexProto", [("file_names", 1, F.TYPE_STRING, rep, ""),
                                     ("function_names", 2, F.TYPE_STRING, rep, "")])
    message("HloModuleProto", [("name", 1, F.TYPE_STRING, opt, ""),
                               ("computations", 3, F.TYPE_MESSAGE, rep, ".xlakit_test.HloComputationProto"),
                               ("schedule", 7, F.TYPE_MESSAGE, opt, ".xlakit_test.HloScheduleProto"),
                               ("stack_frame_index", 17, F.TYPE_MESSAGE, opt, ".xlakit_test.StackFrameIndexProto"),
                               ("frontend_attributes", 19, F.TYPE_MESSAGE, opt, ".xlakit_test.FrontendAttributes")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("xlakit_test.HloModuleProto"))


def hlo_meaning(program: bytes) -> bytes | None:
    """The module as protobuf parses it, less what the key leaves out; None if protobuf refuses it."""
    from google.protobuf.message import DecodeError

    module = hlo_module_class()()
    try:
        module.ParseFromString(program)
    except DecodeError:
        return None
    module.ClearField("stack_frame_index")
    for computation in module.computations:
        for instruction in computation.instructions:
            for name in IGNORED_METADATA:
                instruction.metadata.ClearField(name)
    return module.SerializeToString(deterministic=True)


# -- MLIR ---------------------------------------------------------------------------------------------------


def _mlir_worker() -> None:
    from jax._src.interpreters import mlir
    from jaxlib.mlir._mlir_libs import _stablehlo

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(b"ready\n")
    stdout.flush()
    while header := stdin.read(4):
        program = stdin.read(struct.unpack("<I", header)[0])
        try:
            module = _stablehlo.deserialize_portable_artifact(mlir.make_ir_context(), program)
            answer = b"ok\n" + module.operation.get_asm(enable_debug_info=False).encode()
        except Exception as e:  # noqa: BLE001 - the oracle's answer: this program does not parse
            answer = b"error\n" + str(e).encode(errors="replace")
        stdout.write(struct.pack("<I", len(answer)) + answer)
        stdout.flush()


class MlirOracle:
    """jaxlib's reading of MLIR programs, in a worker process; `close()` ends it.

    A program MLIR aborts on, or reads for longer than `timeout_s`, counts as one it refuses (`crashes`).
    """

    def __init__(self, timeout_s: float = 60.0):
        self._proc = None
        self.timeout_s = timeout_s
        self.crashes = 0

    def _start(self):
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.support.program_oracles", "mlir-worker"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if self._proc.stdout.readline() != b"ready\n":  # jax imported: calls are timed from here
            raise RuntimeError("the MLIR oracle's worker did not start (is jaxlib importable?)")

    def meaning(self, program: bytes) -> str | None:
        """The module printed without locations, or None if it does not deserialize (or MLIR aborts)."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        answer = None
        try:
            self._proc.stdin.write(struct.pack("<I", len(program)) + program)
            self._proc.stdin.flush()
            if select.select([self._proc.stdout], [], [], self.timeout_s)[0]:
                header = self._proc.stdout.read(4)
                answer = self._proc.stdout.read(struct.unpack("<I", header)[0]) if len(header) == 4 else None
        except BrokenPipeError:
            pass
        if answer is None:  # the worker died on this program, or hangs on it
            self.crashes += 1
            self._stop(kill=True)
            return None
        status, _, text = answer.partition(b"\n")
        return text.decode() if status == b"ok" else None

    def _stop(self, *, kill: bool) -> None:
        proc, self._proc = self._proc, None
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
        try:
            proc.wait(timeout=0 if kill else self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    def close(self) -> None:
        if self._proc is not None:
            self._stop(kill=False)


if __name__ == "__main__":
    if sys.argv[1:] == ["mlir-worker"]:
        _mlir_worker()
