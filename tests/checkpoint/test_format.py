"""The file format: storage-faithful as torch.save, read by torch.load, versioned, hashed as written."""

from __future__ import annotations

import io
import json
import pickle
import struct
import zipfile

import pytest
import torch

import xlakit
from xlakit.checkpoint.format import archive


def _tied_model() -> torch.nn.Module:
    torch.manual_seed(0)
    embed = torch.nn.Embedding(32000, 1024)
    head = torch.nn.Linear(1024, 32000, bias=False)
    head.weight = embed.weight
    return torch.nn.ModuleDict({"embed": embed, "head": head})


def test_tied_weights_cost_what_torch_save_costs(tmp_path):
    # Regression: a tied 32000x1024 embedding/head was written twice (250 MiB against 125).
    sd = _tied_model().state_dict()
    assert sd["embed.weight"] is not sd["head.weight"]  # state_dict() detaches: two objects, one storage
    xlakit.save(sd, tmp_path / "x.pt")
    torch.save(sd, tmp_path / "t.pt")
    ours, theirs = (tmp_path / "x.pt").stat().st_size, (tmp_path / "t.pt").stat().st_size
    assert abs(ours - theirs) / theirs < 0.01, (ours, theirs)
    loaded = xlakit.load(tmp_path / "x.pt")
    assert loaded["embed.weight"].untyped_storage().data_ptr() == loaded["head.weight"].untyped_storage().data_ptr()
    assert torch.equal(loaded["head.weight"], sd["head.weight"])


@pytest.mark.xla
def test_tied_xla_weights_are_written_once(tmp_path):
    import torch_xla

    model = _tied_model().to(torch_xla.device())
    model["head"].weight = model["embed"].weight  # .to() unties modules moved to XLA; tie again
    sd = model.state_dict()
    xlakit.save(sd, tmp_path / "x.pt")
    torch.save({k: v.cpu() for k, v in _tied_model().state_dict().items()}, tmp_path / "t.pt")
    ours, theirs = (tmp_path / "x.pt").stat().st_size, (tmp_path / "t.pt").stat().st_size
    assert ours < theirs * 1.01, (ours, theirs)  # torch.save itself writes XLA tensors twice
    loaded = xlakit.load(tmp_path / "x.pt")
    assert loaded["embed.weight"].untyped_storage().data_ptr() == loaded["head.weight"].untyped_storage().data_ptr()


def test_views_keep_their_storage_and_expands_stay_small(tmp_path):
    base = torch.arange(100, dtype=torch.float32)
    state = {"base": base, "view": base[10:20], "strided": base.view(10, 10).t(),
             "expand": torch.ones(1).expand(16 << 20), "scalar_view": base[5]}
    xlakit.save(state, tmp_path / "c.pt")
    assert (tmp_path / "c.pt").stat().st_size < 8192  # the 64 MiB expand is one float on disk
    for loaded in (xlakit.load(tmp_path / "c.pt"), torch.load(tmp_path / "c.pt", weights_only=True)):
        for key, value in state.items():
            assert torch.equal(loaded[key], value) and loaded[key].stride() == value.stride(), key
        ptr = loaded["base"].untyped_storage().data_ptr()
        assert all(loaded[k].untyped_storage().data_ptr() == ptr for k in ("view", "strided", "scalar_view"))
        assert loaded["view"].storage_offset() == 10


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, dtype=torch.complex64).conj(),
    lambda: torch.randn(3).bfloat16(),
    lambda: torch.randn(3).to(torch.float8_e4m3fn),
    lambda: torch.tensor([1, 2, 3], dtype=torch.int32).to(torch.uint16),
    lambda: torch.tensor([True, False]),
    lambda: torch.randn(2, dtype=torch.complex128),
    lambda: torch.nn.Parameter(torch.randn(4)),
    lambda: torch.empty(0, 3),
])
def test_every_dense_kind_round_trips_through_both_readers(tmp_path, make):
    t = make()
    xlakit.save({"t": t}, tmp_path / "c.pt")
    for loaded in (xlakit.load(tmp_path / "c.pt")["t"], torch.load(tmp_path / "c.pt", weights_only=True)["t"]):
        assert loaded.dtype == t.dtype and loaded.shape == t.shape and type(loaded) is type(t)
        assert loaded.is_conj() == t.is_conj()

        def raw(x):
            return x.detach().resolve_conj().contiguous().view(torch.uint8)

        assert torch.equal(raw(loaded), raw(t))  # bit-exact, NaNs and float8 included


@pytest.mark.parametrize("value,why", [
    (torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), "quantized"),
    (torch.randn(3, 3).to_sparse(), "layout"),
    ((lambda b: [b, b.view(torch.int32)])(torch.randn(4)), "shares its storage"),
])
def test_what_cannot_round_trip_is_refused_before_any_byte_is_written(tmp_path, value, why):
    # Regression: a quantized tensor saved "successfully" and loaded into a tensor that
    # crashed on first use.
    path = tmp_path / "c.pt"
    xlakit.save({"old": torch.ones(2)}, path)
    before = path.read_bytes()
    with pytest.raises(xlakit.CheckpointSerializationError, match=why) as info:
        xlakit.save({"model": {"w": value}}, path)
    assert "model/w" in str(info.value)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]


def test_a_newer_format_version_is_refused_naming_both_versions(tmp_path):
    # Regression: a file claiming a newer format version loaded silently.
    path = tmp_path / "c.pt"
    xlakit.save({"w": torch.ones(4)}, path)
    data = path.read_bytes()
    old = b'"version": 2'
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, b'"version": 9'))
    with pytest.raises(xlakit.CheckpointFormatError, match="format version 9.*up to 2"):
        xlakit.load(path)


def test_version_1_files_of_earlier_xlakit_still_load(tmp_path):
    # A version-1 index: storages keyed by tensor, without offsets (written by xlakit <= 0.1).
    buf = io.BytesIO()
    torch.save({"w": torch.arange(4.0)}, buf)
    raw = zipfile.ZipFile(buf)
    pickle_bytes = raw.read("archive/data.pkl") if "archive/data.pkl" in raw.namelist() else None
    path = tmp_path / "v1.pt"
    with zipfile.ZipFile(path, "w") as z:
        for info in raw.infolist():
            z.writestr(info.filename, raw.read(info.filename))
        prefix = raw.namelist()[0].split("/")[0]
        data = raw.read(f"{prefix}/data/0")
        index = {"format": archive.FORMAT, "version": 1, "hash": archive.HASH,
                 "pickle": {"nbytes": len(raw.read(f"{prefix}/data.pkl")),
                            archive.HASH: archive.digest(raw.read(f"{prefix}/data.pkl"))},
                 "storages": {"0": {"path": "w", "nbytes": len(data), "dtype": "float32", "shape": [4],
                                    archive.HASH: archive.digest(data)}}}
        z.writestr(f"{prefix}/{archive.CHECKSUMS_RECORD}", json.dumps(index))
    assert pickle_bytes is None or pickle_bytes
    assert torch.equal(xlakit.load(path)["w"], torch.arange(4.0))


def test_zip_crc32s_are_right_when_asked_for(tmp_path):
    xlakit.save({"w": torch.randn(1 << 16), "n": 3}, tmp_path / "c.pt", compute_crc32=True)
    assert zipfile.ZipFile(tmp_path / "c.pt").testzip() is None


def test_the_index_records_each_storage_at_its_offset_with_its_tensors(tmp_path):
    base = torch.arange(8.0)
    xlakit.save({"a": base, "b": base[2:], "c": torch.ones(3)}, tmp_path / "c.pt")
    data = (tmp_path / "c.pt").read_bytes()
    index = json.loads(bytes(torch._C.PyTorchFileReader(str(tmp_path / "c.pt")).get_record(
        archive.CHECKSUMS_RECORD)))
    assert index["version"] == archive.FORMAT_VERSION
    cols = index["storages"]
    row = int(next(iter(cols["more_paths"])))
    shared = {"paths": [cols["path"][row], *cols["more_paths"][str(row)]], "offset": cols["offset"][row],
              "nbytes": cols["nbytes"][row], archive.HASH: cols[archive.HASH][row]}
    assert shared["paths"] == ["a", "b"] and shared["offset"] % archive.ALIGNMENT == 0
    assert archive.digest(data[shared["offset"]:shared["offset"] + shared["nbytes"]]) == shared[archive.HASH]
    eocd = data.rfind(b"PK\x05\x06")  # the zip's end record; its comment points at the index
    comment = data[eocd + 22:]
    assert struct.unpack_from("<H", data, eocd + 20)[0] == len(comment)
    offset, nbytes = map(int, comment.decode().removeprefix("xlakit-index:").split(":"))
    assert json.loads(data[offset:offset + nbytes]) == index


def _same(a, b, seen=None) -> None:
    """`a` and `b` are the same state: types, keys, values bit for bit, sharing and identity."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad, a.is_conj()) == \
            (b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad, b.is_conj())
        assert bytes(archive.tensor_bytes(a.detach().resolve_conj().contiguous())) == \
            bytes(archive.tensor_bytes(b.detach().resolve_conj().contiguous()))
    elif isinstance(a, dict):
        assert list(a) == list(b) and getattr(a, "__dict__", {}) == getattr(b, "__dict__", {})
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b or (a != a and b != b), (a, b)  # NaN equals NaN here


def _sharing(state) -> list[list[int]]:
    """Which leaves are the same object and which tensors share a storage, by position."""
    leaves = []

    def walk(v):
        if isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        leaves.append(v)

    walk(state)
    ids = [[i for i, y in enumerate(leaves) if y is x] for x in leaves]
    ptrs = [[i for i, y in enumerate(leaves) if isinstance(y, torch.Tensor) and isinstance(x, torch.Tensor)
             and y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()] for x in leaves]
    return ids + ptrs


def test_xlakits_reader_builds_exactly_what_torch_load_builds(tmp_path):
    base = torch.arange(12.0)
    shared_list = [1, 2.5, "x"]
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "base": base, "view": base[3:9].view(2, 3),
             "again": base, "p": torch.nn.Parameter(torch.ones(2)), "conj": torch.randn(2, dtype=torch.complex64).conj(),
             "numbers": (1, -0.0, float("nan"), float("inf"), 2 ** 70, True, None, 1 + 2j, b"\x00\xff"),
             "torch": [torch.float16, torch.Size([2, 3]), torch.device("cpu")], 3: "int key",
             "shared": [shared_list, shared_list], "set": {1, 2}, "empty": {}}
    path = tmp_path / "c.pt"
    xlakit.save(state, path)
    ours, theirs = xlakit.load(path), torch.load(path, weights_only=True)
    _same(ours, theirs)
    assert _sharing(ours) == _sharing(theirs)
    assert ours["shared"][0] is ours["shared"][1]


def test_damage_to_the_index_is_a_checkpoint_error_never_a_raw_one(tmp_path):
    # Regression: one changed byte in the index record ("offset" -> "kffset") gave a raw
    # KeyError from xlakit.load (and from restore), not a CheckpointError.
    path = tmp_path / "c.pt"
    xlakit.save({"a": torch.ones(30), "b": [torch.zeros(2), 3]}, path)
    good = path.read_bytes()
    with open(path, "rb") as f:
        start, n = archive.locate_index(f, len(good))
    end = start + n
    damaged = tmp_path / "d.pt"
    for pos in range(start, end):
        data = bytearray(good)
        data[pos] ^= 0x01
        damaged.write_bytes(bytes(data))
        for call in (lambda: xlakit.load(damaged),
                     lambda: xlakit.restore(damaged, {"a": torch.zeros(30), "b": [torch.zeros(2), 0]})):
            try:
                call()
            except xlakit.CheckpointError:
                pass


def _bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _float_bits(x):
    """Every float of `x` as its 64 bits (dict keys and complex parts included)."""
    if isinstance(x, float):
        return hex(_bits(x))
    if isinstance(x, complex):
        return (_float_bits(x.real), _float_bits(x.imag))
    if isinstance(x, dict):
        out = {_float_bits(k): _float_bits(v) for k, v in x.items() if not isinstance(v, torch.Tensor)}
        return out | ({"attrs": _float_bits(vars(x))} if getattr(x, "__dict__", None) else {})
    if isinstance(x, (list, tuple)):
        return [_float_bits(v) for v in x]
    return x


def test_python_floats_keep_their_bits_as_through_torch_load(tmp_path):
    # Regression: the structure record is JSON, whose NaN reads back as the canonical NaN: a NaN
    # with a payload, a negative NaN or a signalling NaN lost its bits through xlakit.load.
    from collections import OrderedDict

    metrics = OrderedDict(loss=_float(0x7FF8000000000001))
    metrics._metadata = {"scale": _float(0xFFF8000000000000)}
    state = {"payload": _float(0x7FF8000000000123), "signalling": _float(0x7FF0000000000001),
             "negative_zero": -0.0, "canonical": float("nan"), "inf": float("-inf"),
             "complex": complex(_float(0x7FF800000000BEEF), -0.0), "list": [_float(0xFFF80000000000AA), 1.5],
             "metrics": metrics, _float(0x7FF8000000000777): "nan key", "w": torch.ones(2)}
    path = tmp_path / "c.pt"
    xlakit.save(state, path)
    expected = _float_bits(state)
    assert _float_bits(torch.load(path, weights_only=True)) == expected
    assert _float_bits(xlakit.load(path)) == expected
    # restore() matches keys, and a NaN key equals nothing: its state holds the rest.
    del state[next(k for k in state if isinstance(k, float))]
    xlakit.save(state, path)
    template = dict(state, w=torch.zeros(2))
    assert _float_bits(xlakit.restore(path, template)) == _float_bits(state)


def test_nan_bits_leave_the_structure_readable_by_earlier_readers(tmp_path):
    # The bits are an extra key of the record's root: a reader that ignores it (every xlakit before
    # it) reads canonical NaNs and everything else as before; a state without such NaNs adds no key.
    from xlakit.checkpoint.format import structure

    state = {"x": _float(0x7FF8000000000123), "y": [1.25, -0.0], "w": torch.ones(2)}
    plan = state_plan(state)
    record = json.loads(structure.encode(state, plan))
    assert record.pop("nan_bits") == ["7ff8000000000123"] and set(record) == {"dtypes", "state"}
    earlier = structure.decode(json.dumps(record).encode(), structure.spec, "old reader")
    assert _bits(earlier["x"]) == _bits(float("nan")) and _float_bits(earlier["y"]) == _float_bits([1.25, -0.0])
    plain = {"x": float("nan"), "w": torch.ones(2)}
    assert set(json.loads(structure.encode(plain, state_plan(plain)))) == {"dtypes", "state"}


def state_plan(state):
    from xlakit.checkpoint.format import state as plan_module

    return plan_module.plan(state)


class _Marker:
    """A storage (`entry`, `dtype`) or a Parameter's plain tensor (`ref`), as the reference pickles them."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


class _ReferencePickler(pickle.Pickler):
    """How the pickle was written before xlakit emitted it itself: Python's C pickler with a
    persistent_id for storages and a reducer_override for tensors, as torch.save pickles."""

    def __init__(self, file, plan):
        super().__init__(file, protocol=2)
        self._plan = plan
        self._legacy = torch.storage._dtype_to_storage_type_map()

    def persistent_id(self, obj):
        if type(obj) is not _Marker or not hasattr(obj, "entry"):
            return None
        legacy = self._legacy.get(obj.dtype)
        if legacy is not None:
            return ("storage", getattr(torch, legacy), obj.entry.key, "cpu", obj.entry.nbytes // obj.dtype.itemsize)
        return ("storage", torch.UntypedStorage, obj.entry.key, "cpu", obj.entry.nbytes)

    def _rebuild(self, ref, requires_grad):
        meta = torch._utils.get_tensor_metadata(ref.tensor) if not ref.tensor.is_xla else {}
        storage = _Marker(entry=ref.storage, dtype=ref.dtype)
        if self._legacy.get(ref.dtype) is not None:
            return torch._utils._rebuild_tensor_v2, (storage, ref.offset, ref.size, ref.stride, requires_grad,
                                                     None) + ((meta,) if meta else ())
        return torch._utils._rebuild_tensor_v3, (storage, ref.offset, ref.size, ref.stride, requires_grad, None,
                                                 ref.dtype) + ((meta,) if meta else ())

    def reducer_override(self, obj):
        if type(obj) is _Marker:
            return self._rebuild(obj.ref, False)
        if isinstance(obj, torch.Tensor):
            ref = self._plan.tensors[id(obj)]
            if type(obj) is torch.nn.Parameter:
                return torch._utils._rebuild_parameter, (_Marker(ref=ref), obj.requires_grad, None)
            return self._rebuild(ref, obj.requires_grad)
        return NotImplemented


def _states_for_the_pickle():
    from collections import OrderedDict

    base = torch.arange(12.0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    shared = [1, 2.5, "x"]
    yield {"model": model.state_dict(), "opt": opt.state_dict(), "base": base, "view": base[3:9].view(2, 3),
           "again": base, "p": torch.nn.Parameter(torch.ones(2)), "q": torch.nn.Parameter(torch.ones(2), False),
           "conj": torch.randn(2, dtype=torch.complex64).conj(), "neg": torch.randn(2, dtype=torch.complex64).conj().imag,
           "numbers": (1, -0.0, float("nan"), 2 ** 70, -2 ** 40, -5, 300, 70000, True, None, 1 + 2j, b"\x00\xff", b""),
           "torch": [torch.float16, torch.Size([2, 3]), torch.device("cpu")], 3: "int key", "shared": [shared, shared],
           "set": {1, 2}, "empty": {}, "el": [], "et": (), "one": {"a": 1}, "onel": [5], "grad": torch.ones(2, requires_grad=True),
           "f8": torch.zeros(3, dtype=torch.float8_e4m3fn), "u16": torch.zeros(3, dtype=torch.uint16),
           "scalar": torch.tensor(3.0), "expand": torch.ones(1).expand(5), "storage": "storage", "5": "cpu",
           "tuples": ((1, 2, 3, 4, 5), (1,), ((1, 2), [(3,)])), "text": "h\u00e9\U0001f600\udc80"}
    for n in (2, 999, 1000, 1001, 2000):  # the pickler's batches of 1000 items
        yield {str(i): torch.ones(1) for i in range(n)}
        yield [torch.ones(1) for _ in range(n)]
        yield {"od": OrderedDict((str(i), i) for i in range(n)), "d": {i: i for i in range(n)}}
    yield {f"t{i}": torch.randn(3) for i in range(600)}  # memo indices past 255


def test_the_pickle_is_byte_for_byte_what_the_c_pickler_writes():
    # xlakit emits the pickle itself (100,000 tensors cost the C pickler's Python callbacks more than
    # all of torch.save); torch.load and earlier readers see exactly the bytes they always saw.
    from xlakit.checkpoint.format import pickled

    for state in _states_for_the_pickle():
        plan = state_plan(state)
        reference = io.BytesIO()
        _ReferencePickler(reference, plan).dump(state)
        assert pickled.pickle_state(state, plan) == reference.getvalue()


def test_saving_restoring_and_loading_many_tensors_runs_no_cycle_collection(tmp_path):
    # Regression (speed): Python's cycle collector ran again and again over the per-tensor objects of a
    # synchronous save, load or restore: a quarter of their time with 100,000 small tensors.
    import gc

    state = {f"t{i}": torch.full((2,), float(i)) for i in range(20_000)}
    runs = []

    def count(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    path = tmp_path / "c.pt"
    template = {k: torch.zeros(2) for k in state}
    gc.collect()
    gc.callbacks.append(count)
    try:
        xlakit.save(state, path)
        loaded = xlakit.load(path)
        xlakit.restore(path, template)
    finally:
        gc.callbacks.remove(count)
    assert len(runs) <= 6 and gc.isenabled(), runs  # a few as each call ends (the counts it left); 799 before
    assert torch.equal(loaded["t19999"], state["t19999"]) and torch.equal(template["t7"], state["t7"])
