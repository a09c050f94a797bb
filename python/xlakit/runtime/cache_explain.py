"""Why a compile missed: the key records the PJRT wrapper writes beside its entries, compared.

Beside each entry `KEY` the wrapper writes `KEY.parts.json` (csrc/pjrt_wrap/key_record.h): the module's
name and a hash of each part of the key (the program, the program without its constants, the compile
options, XLA_FLAGS, TF_XLA_FLAGS, LIBTPU_INIT_ARGS, the codegen variables, the plugin build, the platform,
the topology, the wrapper version, the key's id), with the parts that are not secret also in words. A
record is a diagnostic: it is never trusted for loading, and a missing or junk one costs an explanation.

`explain` takes a list of (entry name, record) pairs, wherever they were read from (a folder here; a bucket
prefix reads the same records), and for a module with several entries names the nearest other entry of
the newest (fewest differing parts, then the newest) and what differed, in words. Successive entries of
one module that differ only in their constants are the constant trap: a Python number baked into the
graph. Reading never raises on junk: what cannot be read is a note, since diagnostics never crash.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xlakit import _C

PARTS_SUFFIX = _C.PJRT_PARTS_SUFFIX
PARTS_FORMAT = _C.PJRT_PARTS_FORMAT
MAX_PARTS_BYTES = 64 << 10  # csrc/pjrt_wrap/key_record.h kMaxPartsBytes
PARTS_NAME = re.compile(r"([0-9a-f]{64})" + re.escape(PARTS_SUFFIX))
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}")

# The parts a miss is explained by, in this order (key_record.cc kExplained).
EXPLAINED = ("program", "compile_options", "XLA_FLAGS", "TF_XLA_FLAGS", "LIBTPU_INIT_ARGS", "codegen_env",
             "plugin_build", "platform", "topology", "wrapper_version", "key_id")
CONSTANT_TRAP = ("the constant trap: a Python number baked into the graph (`.item()`, a step counter, AdamW "
                 "without `capturable=True`) makes a new program at each new value")
CONSTANT_FIX = ("keep the number a device tensor (never `.item()` it into the graph; "
                "`torch.optim.AdamW(..., capturable=True)`)")


@dataclass(frozen=True)
class Difference:
    part: str
    words: str


@dataclass
class Finding:
    """What is known of one entry's miss: its module, its nearest other entry and what differed."""

    entry: str
    module: str
    entries_of_module: int
    nearest: str | None = None
    nearest_module: str | None = None
    differences: list[Difference] = field(default_factory=list)
    constant_only: bool = False
    # Successive entries of the module (oldest first) that differ only in their constants, of all pairs.
    constant_pairs: int = 0
    pairs: int = 0
    note: str = ""


def parse_record(name: str, data: bytes) -> tuple[dict | None, str]:
    """The record `data` under `name` (`KEY.parts.json`), or None and why it is not one."""
    match = PARTS_NAME.fullmatch(name)
    if match is None:
        return None, "not named KEY.parts.json"
    try:
        record = json.loads(data.decode("utf-8", "replace"))
    except RecursionError:  # nesting deep enough to exhaust the parser: no record the wrapper writes
        return None, "not a key record (nested too deeply)"
    except ValueError as e:
        return None, f"not JSON ({e})"
    if not isinstance(record, dict) or record.get("format") != PARTS_FORMAT:
        return None, f"not a key record (expected format {PARTS_FORMAT!r})"
    if record.get("entry") != match.group(1):
        return None, f"records entry {str(record.get('entry'))[:70]!r}, not its name's (renamed or copied)"
    parts, details = record.get("parts"), record.get("details", {})
    if not (isinstance(parts, dict) and all(isinstance(v, str) for v in parts.values())
            and isinstance(details, dict) and all(isinstance(v, str) for v in details.values())):
        return None, "its parts are not a map of names to strings"
    if not isinstance(record.get("module"), str):
        record["module"] = "unknown"
    written = record.get("written_unix_s")
    if not isinstance(written, (int, float)) or isinstance(written, bool) or not math.isfinite(written):
        record["written_unix_s"] = 0
    # A record may come from a bucket: what is printed of it carries no control character (a terminal's
    # escape sequences) and no lone surrogate.
    record["module"] = _printable(record["module"])
    record["details"] = {_printable(k): _printable(v) for k, v in details.items()}
    record["parts"] = {_printable(k): _printable(v) for k, v in parts.items()}
    return record, ""


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() and not 0xD800 <= ord(c) <= 0xDFFF else f"\\x{ord(c):02x}"
                   if ord(c) < 0x100 else f"\\u{ord(c):04x}" for c in text)


def read_record(path: Path) -> tuple[dict | None, str]:
    """The key record in the file at `path` (a plain file, links not followed, at most MAX_PARTS_BYTES), or None
    and why it is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_PARTS_BYTES:
                return None, f"not a plain file of at most {MAX_PARTS_BYTES} bytes"
            data = f.read(MAX_PARTS_BYTES + 1)
    except OSError as e:
        return None, f"cannot read it ({e})"
    return parse_record(path.name, data)


def read_folder(directory: str | os.PathLike) -> tuple[list[tuple[str, dict]], list[str]]:
    """Every key record of a cache folder as (entry name, record), and notes on what could not be used."""
    folder = Path(directory)
    records: list[tuple[str, dict]] = []
    notes: list[str] = []
    try:
        with os.scandir(folder) as it:
            listing = sorted((d.name, d.stat(follow_symlinks=False)) for d in it)
    except OSError as e:
        return [], [f"cannot list {folder}: {e}"]
    names = {n for n, _ in listing}
    without = 0
    for name, st in listing:
        if _ENTRY_NAME.fullmatch(name) and name + PARTS_SUFFIX not in names:
            without += 1
        if PARTS_NAME.fullmatch(name) is None:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_PARTS_BYTES:
            notes.append(f"ignored {name}: not a plain file of at most {MAX_PARTS_BYTES} bytes")
            continue
        record, why = read_record(folder / name)
        if record is None:
            notes.append(f"ignored {name}: {why}")
            continue
        if name[:64] not in names:
            record["entry_gone"] = True
        if not record["written_unix_s"]:
            record["written_unix_s"] = st.st_mtime
        records.append((name[:64], record))
    if without:
        notes.append(f"{without} entries have no key record (written by an older xlakit, or the record was "
                     "lost): they cannot be explained")
    return records, notes


def _words(flags: str) -> list[str]:
    words = flags.split()
    return words[1:] if words and words[0].endswith(":") else words


def _flag_change(part: str, mine: str, theirs: str) -> str:
    a, b = _words(mine), _words(theirs)
    only_a = [w for w in a if w not in b]
    only_b = [w for w in b if w not in a]
    if not only_a and not only_b:
        return f"{part}: the same flags in another order (kept as written, since they are not all plain)"
    mine_only, theirs_only = " ".join(only_a) or "nothing more", " ".join(only_b) or "nothing more"
    return f"{part}: this entry has {mine_only}; the other has {theirs_only}"


def differences(mine: dict, other: dict) -> list[Difference]:
    """What differs between two records, part by part, in words (the constant trap named as such)."""
    a, b = mine.get("parts", {}), other.get("parts", {})
    da, db = mine.get("details", {}), other.get("details", {})
    out = []
    for part in EXPLAINED:
        if a.get(part) == b.get(part):
            continue
        if part == "program":
            bare = a.get("program_without_constants")
            if bare and bare == b.get("program_without_constants"):
                out.append(Difference("constants", f"only the program's constants: {CONSTANT_TRAP}"))
            else:
                out.append(Difference(part, "the program (its operations or shapes, not only its constants)"))
        elif part in ("XLA_FLAGS", "TF_XLA_FLAGS"):
            out.append(Difference(part, _flag_change(part, da.get(part, ""), db.get(part, ""))))
        elif part == "LIBTPU_INIT_ARGS":
            out.append(Difference(part, "LIBTPU_INIT_ARGS (hashed only: its values may hold secrets)"))
        elif part == "codegen_env":
            pairs = zip(da.get(part, "").split(";"), db.get(part, "").split(";"))
            changed = ", ".join(f"{x} (the other: {y})" for x, y in pairs if x != y)
            out.append(Difference(part, f"the code-generation variables: {changed or 'changed'}"))
        elif part in ("plugin_build", "platform"):
            what = "the plugin build (another libtpu or plugin file)" if part == "plugin_build" else "the platform"
            out.append(Difference(part, f"{what}: {da.get(part, '?')} against {db.get(part, '?')}"))
        elif part == "compile_options":
            out.append(Difference(part, "the compile options (jax also copies XLA_FLAGS into them)"))
        elif part == "topology":
            out.append(Difference(part, "the topology (another slice shape or device kind)"))
        elif part == "wrapper_version":
            out.append(Difference(part, f"the wrapper version ({a.get(part)} against {b.get(part)})"))
        else:
            out.append(Difference(part, f"the cache key (XLAKIT_CACHE_KEY id {a.get(part)} against {b.get(part)})"))
    return out


def _constant_only(diffs: list[Difference]) -> bool:
    return [d.part for d in diffs] == ["constants"]


def _nearest(name: str, record: dict, others: list[tuple[str, dict]]) -> tuple[str, dict, list[Difference]] | None:
    best = None
    for other_name, other in others:
        if other_name == name:
            continue
        diffs = differences(record, other)
        rank = (len(diffs), -other["written_unix_s"])
        if best is None or rank < best[0]:
            best = (rank, other_name, other, diffs)
    return None if best is None else best[1:]


def _finding(name: str, record: dict, group: list[tuple[str, dict]], everyone: list[tuple[str, dict]]) -> Finding:
    module = record.get("module", "unknown")
    f = Finding(entry=name, module=module, entries_of_module=len(group))
    ordered = sorted(group, key=lambda r: r[1]["written_unix_s"])
    for (_, older), (_, newer) in zip(ordered, ordered[1:]):
        f.pairs += 1
        f.constant_pairs += _constant_only(differences(newer, older))
    near = _nearest(name, record, group)
    if near is None:
        near = _nearest(name, record, everyone)
        f.note = f"no other entry of module {module}" + ("; the nearest entry of any module:" if near else "")
    if near is not None:
        f.nearest, other, f.differences = near
        f.nearest_module = other.get("module", "unknown")
        f.constant_only = _constant_only(f.differences)
        if not f.differences:
            f.note = "no recorded part differs: the entry under this key was refused or rewritten"
    return f


def explain(records: list[tuple[str, dict]], *, entry: str | None = None) -> list[Finding]:
    """For each module with several entries (or the entry named, by its name or a prefix of it), its newest
    entry's nearest other entry and what differed; with no module of several entries, the newest entry.

    `records`: (entry name, record) pairs, as `read_folder` or `parse_record` give them.
    Raises:
        ValueError: `entry` names no record, or several.
    """
    records = [(n, {**r, "written_unix_s": r.get("written_unix_s") if isinstance(r.get("written_unix_s"), (int, float))
                    else 0}) for n, r in records if isinstance(r, dict) and isinstance(r.get("parts"), dict)]
    groups: dict[str, list[tuple[str, dict]]] = {}
    for name, record in records:
        groups.setdefault(record.get("module", "unknown"), []).append((name, record))
    if entry is not None:
        chosen = [(n, r) for n, r in records if n.startswith(entry)]
        if len(chosen) != 1:
            raise ValueError(f"expected one entry named {entry!r} (or starting so) with a key record; found "
                             f"{len(chosen)}: give more of its name (`xlakit cache ls` lists them)")
        name, record = chosen[0]
        return [_finding(name, record, groups[record.get("module", "unknown")], records)]
    findings = []
    for module, group in sorted(groups.items()):
        if len(group) > 1:
            name, record = max(group, key=lambda r: (r[1]["written_unix_s"], r[0]))
            findings.append(_finding(name, record, group, records))
    if not findings and records:
        name, record = max(records, key=lambda r: (r[1]["written_unix_s"], r[0]))
        findings.append(_finding(name, record, groups[record.get("module", "unknown")], records))
    return findings


def render(findings: list[Finding], notes: list[str]) -> str:
    """The findings in words, one block per module."""
    lines = []
    for f in findings:
        lines.append(f"module {f.module}: {f.entries_of_module} entr{'y' if f.entries_of_module == 1 else 'ies'}; "
                     f"the newest is {f.entry[:16]}")
        if f.note:
            lines.append(f"  {f.note}")
        if f.nearest is not None:
            other = "" if f.nearest_module == f.module else f" (module {f.nearest_module})"
            lines.append(f"  nearest other entry {f.nearest[:16]}{other} differs in {len(f.differences)} "
                         f"part{'' if len(f.differences) == 1 else 's'}:")
            lines += [f"    - {d.words}" for d in f.differences]
        if f.constant_pairs:
            lines.append(f"  {f.constant_pairs} of {f.pairs} successive entries of this module differ only in the "
                         f"program's constants: {CONSTANT_TRAP}.")
            lines.append(f"  fix: {CONSTANT_FIX}")
    if not findings:
        lines.append("no key records to compare (an empty folder, or entries written before xlakit recorded "
                     "their key's parts)")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def to_json(findings: list[Finding], notes: list[str]) -> dict:
    out = []
    for f in findings:
        d = asdict(f)
        d["constant_trap"] = bool(f.constant_pairs) or f.constant_only
        if d["constant_trap"]:
            d["fix"] = CONSTANT_FIX
        out.append(d)
    return {"findings": out, "notes": notes, "read_at_unix_s": time.time()}
