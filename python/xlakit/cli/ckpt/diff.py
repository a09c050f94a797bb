"""`xlakit ckpt diff`: which tensors differ between two checkpoints, and by how much."""

from __future__ import annotations

import argparse


from xlakit.cli.ckpt.common import OK, DIFFERENT, emit, about, read_state


def cmd_diff(args: argparse.Namespace) -> int:
    from xlakit.checkpoint.inspect import tensors

    with about(args.a):
        a = read_state(args.a)
    with about(args.b):
        b = read_state(args.b)
    result = tensors.compare(a, b)
    text = [f"only in A: {n}" for n in result["only_in_a"]] + [f"only in B: {n}" for n in result["only_in_b"]]
    text += [f"structure differs: {s['name']}: {s['a']} vs {s['b']}" for s in result["structure_different"]]
    text += [f"dtype/shape: {m['name']}: {m['a']} vs {m['b']}" for m in result["mismatched"]]
    text += [_difference_line(d) for d in result["different"]]
    text += [f"value differs: {v['name']}: {v['a']!r} vs {v['b']!r}" for v in result["values_different"]]
    text.append("identical" if result["identical"] else
                f"{len(result['different']) + len(result['mismatched'])} tensor(s) differ, {result['same']} equal"
                f"; {len(result['structure_different'])} structure and {len(result['values_different'])} "
                f"value difference(s)")
    emit(args, {"a": args.a, "b": args.b, **result}, text)
    return OK if result["identical"] else DIFFERENT


def _difference_line(d: dict) -> str:
    nan = (f" ({d['nan_vs_number']} where a NaN stands against a number)" if d["nan_vs_number"] else "")
    return (f"differs: {d['name']}: {d['differing']} of {d['elements']} element(s), max abs difference "
            f"{d['max_abs_diff']:g}{nan}")
