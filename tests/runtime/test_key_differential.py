"""Differential test of the cache key's canonical program bytes (issue 32 item 4, "no wrong hit, by test").

A key hashes a program's canonical bytes, in which what never changes the executable is left out: an MLIR
program's locations and the file names only they name (csrc/pjrt_wrap/mlir_bytecode.h), an HLO module's
debug metadata, and the order of map entries (proto_canon.h). Two programs with equal canonical bytes share
a cache entry, so they must mean the same program. Here thousands of mutants of real captured programs
(tests/runtime/programs/: jax's MLIR bytecode and torch_xla's HloModuleProtos as handed to a PJRT plugin, and
the review's constructions) are canonicalised by the built wrapper itself, and every two with equal canonical
bytes are compared as their own parsers read them (tests/support/program_oracles.py): jaxlib's MLIR printed
without locations, protobuf's parse with the ignored fields cleared. Both refused counts as equal.

The seed is random per run and named in every failure; XLAKIT_TEST_KEY_SEED=N repeats a run.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from pathlib import Path
from typing import Callable

import pytest

from tests.support import key_canon, program_mutations, program_oracles

PROGRAMS = Path(__file__).parent / "programs"
MUTANTS = 4000  # per format and run
SEED = int(os.environ.get("XLAKIT_TEST_KEY_SEED") or random.SystemRandom().randrange(1 << 32))

pytestmark = pytest.mark.slow


def _differential(programs: dict[str, bytes], mutate: Callable, fmt: str, meaning: Callable, tmp_path: Path):
    """(mutants made, pairs compared, seconds) after comparing every two of equal canonical bytes."""
    rng = random.Random(SEED)
    start = time.monotonic()
    groups: dict[bytes, dict[bytes, str]] = {}

    def add(program: bytes, note: str) -> None:
        key = hashlib.sha256(key_canon.canonical_program(fmt, program)).digest()
        groups.setdefault(key, {}).setdefault(program, note)

    for name, program in programs.items():
        add(program, name)
    names = sorted(programs)
    for _ in range(MUTANTS):
        name = rng.choice(names)
        try:
            mutant, note = mutate(rng, programs[name])
        except Exception as e:  # a bug of the mutator: the seed repeats it
            e.add_note(f"mutating {name}: seed {SEED} (XLAKIT_TEST_KEY_SEED={SEED} repeats this run)")
            raise
        add(mutant, f"{name}: {note}")
    meanings: dict[bytes, object] = {}
    pairs = 0
    for members in groups.values():
        first, *rest = members
        for other in rest:
            pairs += 1
            for p in (first, other):
                if p not in meanings:
                    meanings[p] = meaning(p)
            if meanings[first] != meanings[other]:
                (tmp_path / "a").write_bytes(first)
                (tmp_path / "b").write_bytes(other)
                pytest.fail(f"equal canonical bytes, different programs (seed {SEED}; both in {tmp_path}):\n"
                            f"  a: {members[first]}\n  b: {members[other]}")
    return MUTANTS, pairs, time.monotonic() - start


def test_mlir_programs_with_equal_canonical_bytes_print_alike(tmp_path):
    pytest.importorskip("jax", reason="the MLIR oracle is jaxlib's MLIR (the cpu-dev profile installs it)")
    programs = {p.name: p.read_bytes() for p in sorted(PROGRAMS.glob("*.mlir"))}
    oracle = program_oracles.MlirOracle()
    try:
        made, pairs, seconds = _differential(programs, program_mutations.mutate_mlir, "mlir", oracle.meaning,
                                             tmp_path)
    finally:
        oracle.close()
    print(f"mlir: {made} mutants, {pairs} pairs of equal canonical bytes compared, {seconds:.1f} s, seed {SEED}")
    assert pairs >= made // 20  # the mutations reach what the key leaves out, or this proves nothing


def test_hlo_programs_with_equal_canonical_bytes_parse_alike(tmp_path):
    pytest.importorskip("google.protobuf", reason="the HLO oracle is protobuf's own parser")
    programs = {p.name: p.read_bytes() for p in sorted(PROGRAMS.glob("*.hlo"))}
    programs.update((p.name, p.read_bytes()) for p in sorted(PROGRAMS.glob("review_hlo*.pb")))
    parsed = {name: program_mutations.parse_pb(p) for name, p in programs.items()}

    def mutate(rng, program):
        name = next(n for n, p in programs.items() if p is program)
        return program_mutations.mutate_hlo(rng, program, parsed[name])

    made, pairs, seconds = _differential(programs, mutate, "hlo", program_oracles.hlo_meaning, tmp_path)
    print(f"hlo: {made} mutants, {pairs} pairs of equal canonical bytes compared, {seconds:.1f} s, seed {SEED}")
    assert pairs >= made // 20
