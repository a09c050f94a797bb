"""Mutations of real programs, for the cache key's differential test (tests only).

Two containers, edited structurally so that most mutants stay well formed and many land where the key's
canonicalisation leaves bytes out (csrc/pjrt_wrap/mlir_bytecode.h, proto_canon.h):

* MLIR bytecode (`Bytecode`): the header, sections, string table and attribute/type entries are read and
  written back (sizes, offsets and alignment recomputed), so a string, an entry or a varint inside one can
  change alone: file names, locations, a string an attribute names, an index spelled with extra bytes.
* protobuf (`Proto`): the wire format as a tree along the fields the key knows (HloModuleProto's
  computations, instructions, metadata, frontend attributes, schedule, stack frame index); a mutation
  rebuilds only the path it changed: metadata fields changed, added twice, with another wire type or
  invalid UTF-8; map entries added, repeated, reordered, with a key twice or a tag spelled long; lengths
  spelled long.

Every mutation is a pure function of the program and a `random.Random`; `mutate_*` applies one to three.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# -- MLIR bytecode ------------------------------------------------------------------------------------------


def mlir_varint(value: int, size: int | None = None) -> bytes:
    """`value` as an MLIR prefix varint of `size` bytes (default: the shortest, as MLIR's writer)."""
    shortest = 9 if value >> 56 else next(n for n in range(1, 9) if n == 8 or not value >> (7 * n))
    size = size or shortest
    assert size >= shortest
    if size == 9:
        return b"\0" + value.to_bytes(8, "little")
    return ((value << size) | (1 << (size - 1))).to_bytes(size, "little")


def read_mlir_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, size) of the varint at `pos`; IndexError past the end."""
    first = data[pos]
    size = 9 if first == 0 else (first & -first).bit_length()
    if pos + size > len(data):
        raise IndexError(pos)
    if size == 9:
        return int.from_bytes(data[pos + 1:pos + 9], "little"), 9
    return int.from_bytes(data[pos:pos + size], "little") >> size, size


class _Reader:
    def __init__(self, data: bytes, pos: int = 0):
        self.data, self.pos = data, pos

    def varint(self) -> int:
        value, size = read_mlir_varint(self.data, self.pos)
        self.pos += size
        return value

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise IndexError(n)
        self.pos += n
        return self.data[self.pos - n:self.pos]


@dataclass
class Entry:
    dialect: int
    custom: bool
    data: bytes


@dataclass
class Bytecode:
    """An MLIR bytecode program, read far enough to edit strings and entries."""

    header: bytes
    sections: list[list]  # [id, align, data]: data of sections 0, 2 and 3 is rebuilt by dump()
    strings: list[bytes]
    dialects: list[int]  # each dialect's name, a string index
    num_attrs: int
    entries: list[Entry] = field(default_factory=list)

    @classmethod
    def parse(cls, data: bytes) -> "Bytecode":
        r = _Reader(data, 4)
        if data[:4] != b"ML\xefR":
            raise ValueError("not MLIR bytecode")
        r.varint()
        r.pos = data.index(b"\0", r.pos) + 1
        header = data[:r.pos]
        sections = []
        while r.pos < len(data):
            sid, size = r.take(1)[0], r.varint()
            align = 1
            if sid & 0x80:
                align = r.varint()
                while r.pos % align:
                    r.take(1)
            sections.append([sid & 0x7F, align, r.take(size)])
        body = {s[0]: s[2] for s in sections}
        s = _Reader(body[0])
        sizes = [s.varint() for _ in range(s.varint())][::-1]
        strings = [s.take(n)[:-1] for n in sizes]
        d = _Reader(body[1])
        dialects = []
        for _ in range(d.varint()):
            flagged = d.varint()
            dialects.append(flagged >> 1)
            if flagged & 1:
                d.take(1)
                d.take(d.varint())
        o, at = _Reader(body[3]), 0
        num_attrs, num_types = o.varint(), o.varint()
        entries = []
        for total in (num_attrs, num_types):
            done = 0
            while done < total:
                dialect, count = o.varint(), o.varint()
                for _ in range(count):
                    flagged = o.varint()
                    entries.append(Entry(dialect, bool(flagged & 1), body[2][at:at + (flagged >> 1)]))
                    at += flagged >> 1
                done += count
        return cls(header, sections, strings, dialects, num_attrs, entries)

    def dialect_name(self, entry: Entry) -> bytes:
        return self.strings[self.dialects[entry.dialect]]

    def dump(self) -> bytes:
        strings = mlir_varint(len(self.strings)) + b"".join(mlir_varint(len(s) + 1) for s in self.strings[::-1])
        strings += b"".join(s + b"\0" for s in self.strings)
        offsets = mlir_varint(self.num_attrs) + mlir_varint(len(self.entries) - self.num_attrs)
        for part in (self.entries[:self.num_attrs], self.entries[self.num_attrs:]):
            i = 0
            while i < len(part):
                j = i
                while j < len(part) and part[j].dialect == part[i].dialect:
                    j += 1
                offsets += mlir_varint(part[i].dialect) + mlir_varint(j - i)
                offsets += b"".join(mlir_varint(len(e.data) << 1 | e.custom) for e in part[i:j])
                i = j
        rebuilt = {0: strings, 2: b"".join(e.data for e in self.entries), 3: offsets}
        out = bytearray(self.header)
        for sid, align, data in self.sections:
            data = rebuilt.get(sid, data)
            out += bytes([sid | (0x80 if align > 1 else 0)]) + mlir_varint(len(data))
            if align > 1:
                out += mlir_varint(align)
                while len(out) % align:
                    out.append(0xCB)
            out += data
        return bytes(out)


def _file_names(bc: Bytecode) -> list[int]:
    return [i for i, s in enumerate(bc.strings) if b"/" in s or s.endswith(b".py") or s.startswith(b"<")]


def _edit_string(rng: random.Random, bc: Bytecode) -> str:
    """A string changed: half the time one that looks like a file name (a location's, or not)."""
    names = _file_names(bc)
    i = rng.choice(names) if names and rng.random() < 0.5 else rng.randrange(len(bc.strings))
    s = bytearray(bc.strings[i])
    how = rng.choice(["char", "append", "drop", "copy", "path"])
    if how == "char" and s:
        s[rng.randrange(len(s))] = rng.randrange(0x21, 0x7F)
    elif how == "append":
        s += bytes([rng.randrange(0x61, 0x7B)])
    elif how == "drop" and s:
        del s[rng.randrange(len(s))]
    elif how == "copy":
        s = bytearray(rng.choice(bc.strings))
    else:
        s = bytearray(b"/elsewhere/%d/train.py" % rng.randrange(100))
    bc.strings[i] = bytes(s)
    return f"string {i} {how}"


def _varint_positions(data: bytes) -> list[int]:
    out = []
    for pos in range(len(data)):
        try:
            read_mlir_varint(data, pos)
        except IndexError:
            continue
        out.append(pos)
    return out


def _edit_entry_byte(rng: random.Random, bc: Bytecode) -> str:
    i = rng.randrange(len(bc.entries))
    data = bytearray(bc.entries[i].data)
    if not data:
        return "entry empty"
    pos = rng.randrange(len(data))
    data[pos] = rng.randrange(256) if rng.random() < 0.5 else data[pos] ^ (1 << rng.randrange(8))
    bc.entries[i].data = bytes(data)
    return f"entry {i} byte {pos}"


def _respell_varint(rng: random.Random, bc: Bytecode) -> str:
    """A varint inside an entry written again with more bytes (MLIR's reader takes any length)."""
    i = rng.randrange(len(bc.entries))
    data = bc.entries[i].data
    positions = _varint_positions(data)
    if not positions:
        return "entry without varints"
    pos = rng.choice(positions)
    value, size = read_mlir_varint(data, pos)
    if size == 9:
        return "varint already 9 bytes"
    longer = mlir_varint(value, rng.choice([n for n in range(size + 1, 10)]))
    bc.entries[i].data = data[:pos] + longer + data[pos + size:]
    return f"entry {i} varint at {pos} respelled in {len(longer)} bytes"


def _retarget(rng: random.Random, bc: Bytecode) -> str:
    """An index inside an entry pointed at another string or attribute, spelled short or long."""
    i = rng.randrange(len(bc.entries))
    data = bc.entries[i].data
    positions = _varint_positions(data)[1:]  # past the dialect's code
    if not positions:
        return "entry without operands"
    pos = rng.choice(positions)
    _, size = read_mlir_varint(data, pos)
    target = rng.randrange(max(len(bc.strings), bc.num_attrs))
    if rng.random() < 0.3:
        target = 2 * target + 1  # an optional reference
    shortest = len(mlir_varint(target))
    spelled = mlir_varint(target, rng.choice([shortest, shortest, min(9, shortest + 1)]))
    bc.entries[i].data = data[:pos] + spelled + data[pos + size:]
    return f"entry {i} index at {pos} -> {target} in {len(spelled)} bytes"


def _move_location(rng: random.Random, bc: Bytecode) -> str:
    """A builtin FileLineColLoc or FileLineColRange given other lines and columns (code moved in its file)."""
    locations = [i for i, e in enumerate(bc.entries[:bc.num_attrs])
                 if e.custom and bc.dialect_name(e) == b"builtin" and e.data[:1] in (mlir_varint(11), mlir_varint(22))]
    if not locations:
        return "no file location"
    i = rng.choice(locations)
    code, size = read_mlir_varint(bc.entries[i].data, 0)
    name, name_size = read_mlir_varint(bc.entries[i].data, size)
    numbers = [rng.randrange(1 << rng.choice([3, 7, 14])) for _ in range(2 if code == 11 else rng.randrange(5))]
    rest = b"".join(mlir_varint(n) for n in numbers)
    if code == 22:
        rest = mlir_varint(len(numbers)) + rest
    bc.entries[i].data = mlir_varint(code) + mlir_varint(name) + rest
    return f"location {i} moved to {numbers}"


def _attack(rng: random.Random, bc: Bytecode) -> str:
    """The review's shape: a string attribute of the vhlo dialect made to name a location's file name."""
    vhlo = [i for i, e in enumerate(bc.entries[:bc.num_attrs])
            if e.custom and bc.dialect_name(e) == b"vhlo" and e.data[:1] == mlir_varint(14)]
    names = _file_names(bc)
    if not vhlo or not names:
        return "no vhlo string attribute or file name"
    i, target = rng.choice(vhlo), rng.choice(names)
    bc.entries[i].data = mlir_varint(14) + mlir_varint(target, rng.choice([None, 2, 3, 9]))
    return f"vhlo string {i} names string {target}, then " + _edit_string(rng, bc)


_MLIR_MUTATIONS = [(_edit_string, 4), (_move_location, 3), (_edit_entry_byte, 3), (_respell_varint, 2),
                   (_retarget, 2), (_attack, 1)]


def mutate_mlir(rng: random.Random, program: bytes) -> tuple[bytes, str]:
    """One to three structural mutations of `program`, sometimes a raw byte flip after them."""
    bc = Bytecode.parse(program)
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        fn = rng.choices([m for m, _ in _MLIR_MUTATIONS], [w for _, w in _MLIR_MUTATIONS])[0]
        try:
            done.append(fn(rng, bc))
        except IndexError:  # an earlier mutation cut the entry this one reads short: any bytes are a fine input
            done.append(f"{fn.__name__.lstrip('_')}: its entry was cut short")
    out = bytearray(bc.dump())
    if rng.random() < 0.1:
        pos = rng.randrange(len(out))
        out[pos] = rng.randrange(256)
        done.append(f"raw byte {pos}")
    return bytes(out), "; ".join(done)


# -- protobuf -----------------------------------------------------------------------------------------------


def pb_varint(value: int, extra: int = 0) -> bytes:
    """`value` as a protobuf varint, with `extra` redundant bytes (which parsers accept)."""
    out = bytearray()
    while True:
        out.append(value & 0x7F)
        value >>= 7
        if not value:
            break
        out[-1] |= 0x80
    if extra:
        out[-1] |= 0x80
        out += b"\x80" * (extra - 1) + b"\0"
    return bytes(out)


def _read_pb_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


# HloModuleProto's messages the key looks into: field -> the message it holds.
_HLO_CHILDREN = {
    "module": {3: "computation", 7: "schedule", 17: "stack_frame_index", 19: "frontend_attributes"},
    "computation": {2: "instruction"},
    "instruction": {7: "metadata", 68: "frontend_attributes"},
}


@dataclass
class PbField:
    number: int
    wire: int
    raw: bytes  # the whole field as written (tag, length, payload)
    kind: str | None = None  # a known message: its fields follow
    fields: list["PbField"] | None = None


_KINDS = {kind for children in _HLO_CHILDREN.values() for kind in children.values()}


def parse_pb(data: bytes, kind: str = "module") -> list[PbField]:
    """The fields of a message of `kind`; ValueError if it is not well formed."""
    out, pos = [], 0
    try:
        while pos < len(data):
            start = pos
            tag, pos = _read_pb_varint(data, pos)
            number, wire = tag >> 3, tag & 7
            body = None
            if wire == 0:
                _, pos = _read_pb_varint(data, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            elif wire == 2:
                n, body_at = _read_pb_varint(data, pos)
                pos = body_at + n
                body = data[body_at:pos]
            else:
                raise ValueError("group")
            if pos > len(data):
                raise ValueError("truncated")
            f = PbField(number, wire, data[start:pos])
            child = _HLO_CHILDREN.get(kind, {}).get(number)
            if child and body is not None:
                f.kind, f.fields = child, parse_pb(body, child)
            out.append(f)
    except IndexError as e:
        raise ValueError("truncated") from e
    return out


def pb_field(number: int, wire: int, payload: bytes | int, *, tag_extra: int = 0, len_extra: int = 0) -> bytes:
    tag = pb_varint(number << 3 | wire, tag_extra)
    if wire == 0:
        return tag + pb_varint(payload)
    return tag + pb_varint(len(payload), len_extra) + payload


def _messages(fields: list[PbField], path=()) -> list[tuple[tuple, str]]:
    """Every known message under `fields`: (path of field positions, kind)."""
    out = []
    for i, f in enumerate(fields):
        if f.fields is not None:
            out.append((path + (i,), f.kind))
            out += _messages(f.fields, path + (i,))
    return out


def _splice(fields: list[PbField], path: tuple, edit) -> bytes:
    """The message's bytes with `edit(body: bytes) -> bytes` applied to the message at `path`."""
    if not path:
        return edit(b"".join(f.raw for f in fields))
    i, f = path[0], fields[path[0]]
    body = _splice(f.fields, path[1:], edit)
    rebuilt = pb_field(f.number, 2, body)
    return b"".join(g.raw if k != i else rebuilt for k, g in enumerate(fields))


_STRINGS = [b"", b"k", b"a", b"X", b"Y", b"jit(f)/add", b"\xff\xfe", b"caf\xc3\xa9"]


def _entry(rng: random.Random, key_wire: int) -> bytes:
    """A map entry, mostly plain, sometimes with a key twice, a long tag, no key or a key of another type."""
    key = rng.choice(_STRINGS[:4]) if key_wire == 2 else rng.randrange(4)
    parts = [pb_field(1, key_wire, key, tag_extra=1 if rng.random() < 0.15 else 0)]
    if rng.random() < 0.1:
        parts.append(pb_field(1, key_wire, rng.choice(_STRINGS[:4]) if key_wire == 2 else rng.randrange(4)))
    if rng.random() < 0.1:
        parts = [] if rng.random() < 0.5 else [pb_field(1, 2 - key_wire, b"k" if key_wire == 0 else 1)]
    value = pb_field(2, 2, rng.choice(_STRINGS[:5]) if key_wire == 2 else pb_field(1, 0, rng.randrange(9)))
    parts.append(value)
    if rng.random() < 0.05:
        parts.append(value)
    if rng.random() < 0.5:
        parts.reverse()
    return b"".join(parts)


def _mutate_message(rng: random.Random, kind: str, body: bytes) -> tuple[bytes, str]:
    fields = parse_pb(body, kind)
    if kind == "metadata":
        number = rng.choice([1, 2, 3, 4, 15, 17, 18, 19] if rng.random() < 0.8 else [12, 13, 16])  # dropped, kept
        wire = 2 if number in (1, 2, 3, 12, 16) else 0
        if rng.random() < 0.1:
            wire = 2 - wire  # another field to a parser
        payload = rng.choice(_STRINGS) if wire == 2 else rng.randrange(1 << rng.choice([3, 10, 31]))
        new = pb_field(number, wire, payload, tag_extra=1 if rng.random() < 0.1 else 0)
        keep = [f.raw for f in fields if f.number != number or rng.random() < 0.3]
        keep.insert(rng.randrange(len(keep) + 1), new)
        return b"".join(keep), f"metadata field {number}/{wire}"
    if kind in ("frontend_attributes", "schedule"):
        key_wire = 2 if kind == "frontend_attributes" else 0
        entries = [f.raw for f in fields]
        how = rng.choice(["add", "add", "shuffle", "drop"])
        if how == "add":
            entries.insert(rng.randrange(len(entries) + 1),
                           pb_field(1, 2, _entry(rng, key_wire), tag_extra=1 if rng.random() < 0.1 else 0))
        elif how == "shuffle":
            rng.shuffle(entries)
        elif entries:
            entries.pop(rng.randrange(len(entries)))
        return b"".join(entries), f"{kind} {how}"
    if kind == "stack_frame_index":
        return body + pb_field(rng.choice([1, 2]), 2, rng.choice(_STRINGS)), "stack frame index string"
    # module, computation, instruction: a field spelled long, repeated or removed, or a map added.
    if not fields:
        return body, "empty"
    i = rng.randrange(len(fields))
    f = fields[i]
    tag, at = _read_pb_varint(f.raw, 0)
    how = rng.choice(["long tag", "long length", "twice", "remove", "add map"])
    if how == "long length" and f.wire != 2:
        how = "long tag"
    number = {"module": 19, "instruction": 68}.get(kind)
    if how == "add map" and number is None:
        how = "twice"
    if how == "long tag":
        raw = pb_varint(tag, 1) + f.raw[at:]
    elif how == "long length":
        n, body_at = _read_pb_varint(f.raw, at)
        raw = f.raw[:at] + pb_varint(n, 1) + f.raw[body_at:]
    elif how == "twice":
        raw = f.raw + f.raw
    elif how == "remove":
        raw = b""
    else:
        raw = f.raw + pb_field(number, 2, pb_field(1, 2, _entry(rng, 2)))
    return b"".join(g.raw if k != i else raw for k, g in enumerate(fields)), f"{kind} field {f.number} {how}"


def mutate_hlo(rng: random.Random, program: bytes, fields: list[PbField] | None = None) -> tuple[bytes, str]:
    """One to three mutations of a serialized HloModuleProto (`fields`: parse_pb(program), if at hand)."""
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        try:
            fields = fields if fields is not None else parse_pb(program)
        except ValueError:
            break  # an earlier mutation left it unreadable here: it stays as it is
        targets = [((), "module")] + _messages(fields)
        # Mostly where the key looks: metadata and maps.
        weights = [4 if kind in ("metadata", "frontend_attributes", "schedule") else 1 for _, kind in targets]
        path, kind = rng.choices(targets, weights)[0]
        note = []

        def edit(body: bytes, kind=kind, note=note) -> bytes:
            new, what = _mutate_message(rng, kind, body)
            note.append(what)
            return new

        program = _splice(fields, path, edit)
        done.append(note[0])
        fields = None
    if program and rng.random() < 0.05:
        out = bytearray(program)
        pos = rng.randrange(len(out))
        out[pos] = rng.randrange(256)
        program = bytes(out)
        done.append(f"raw byte {pos}")
    return program, "; ".join(done)
