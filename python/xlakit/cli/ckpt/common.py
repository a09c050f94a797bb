"""What every `xlakit ckpt` subcommand shares: exit codes, output (`--json` or text), sizes, reading a state."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any



OK, DIFFERENT, ERROR, NOTHING = 0, 1, 2, 3


EPILOG = ("exit codes: 0 success; 1 verify found damage, or diff found differences; 2 error (bad argument, "
           "missing path, not a checkpoint, unreadable source); 3 verify found nothing to check (no checksums, "
           "no committed step); 130 interrupted")


# What a pickle names to run code, not to rebuild a value: never allowed through --allow-global, never offered.
_RUNS_CODE_MODULES = ("os", "posix", "nt", "subprocess", "sys", "importlib", "runpy", "pickle", "_pickle", "shutil",
                      "socket", "code", "codeop", "pty", "ctypes", "marshal", "types", "multiprocessing", "webbrowser",
                      "torch._C", "torch.ops")
_RUNS_CODE_BUILTINS = {"eval", "exec", "compile", "__import__", "getattr", "setattr", "delattr", "open", "input",
                       "breakpoint", "globals", "locals", "vars", "exit", "quit", "help", "memoryview"}


def runs_code(name: str) -> bool:
    """Whether `module.Name` is a way to run code or reach the system (os.system, builtins.eval, ...)."""
    module, _, attr = name.rpartition(".")
    if module in ("builtins", "__builtin__"):
        return attr in _RUNS_CODE_BUILTINS
    return any(module == m or module.startswith(m + ".") for m in _RUNS_CODE_MODULES)


def code_refusal(name: str) -> str:
    return (f"{name} runs code or reaches the system: a pickle that calls it is an attack, not a value, and "
            f"xlakit never allows it; do not load this file")


@contextlib.contextmanager
def allowing(names: list[str] | None) -> Iterator[None]:
    """Inside, a weights-only load also accepts the classes `names` (`--allow-global module.Name`), as
    `torch.serialization.add_safe_globals` would: the user's word that they trust them. Each is allowed
    under the name given, as the refusal named it, which may not be where it lives now (a numpy 1.x
    pickle's numpy.core.multiarray._reconstruct)."""
    if not names:
        yield
        return
    import torch

    with torch.serialization.safe_globals([(_resolve(name), name) for name in names]):
        yield


def _resolve(name: str) -> Any:
    """The class or function `module.Name` (or `module.Outer.Inner`) names; ValueError saying why not."""
    import importlib

    if runs_code(name):
        raise ValueError(f"--allow-global {name}: {code_refusal(name)}")
    module, obj, problem = name, None, "it is not MODULE.NAME"
    while "." in module and obj is None and all(name.split(".")):
        module = module.rpartition(".")[0]
        try:
            obj = importlib.import_module(module)
        except ImportError as e:
            problem = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - a module that fails as it is imported: its error, one line
            problem = f"importing {module} failed with {type(e).__name__}: {e}"
            break
    try:
        for attr in (name[len(module) + 1:].split(".") if obj is not None else ()):
            obj = getattr(obj, attr)
    except AttributeError as e:
        obj, problem = None, f"AttributeError: {e}"
    fix = ("give its module and name as the error that refused it named it, e.g. --allow-global "
           "argparse.Namespace")
    if obj is None:
        raise ValueError(f"--allow-global {name}: no such class or function ({problem}); {fix}")
    if not callable(obj):
        raise ValueError(f"--allow-global {name}: it is a {type(obj).__name__}, not a class or function, "
                         f"which is all a pickle names; {fix}")
    return obj


def size(n: float) -> str:
    from xlakit.checkpoint.core.operation import human_bytes

    return human_bytes(n)


# A checkpoint's names and values are its author's: printed raw, a newline forges a line and an escape
# sequence rewrites the terminal. Shown escaped, as Python writes them.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(line: str) -> str:
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], line)


def emit(args: argparse.Namespace, data: dict, text: list[str]) -> None:
    if args.json:
        from xlakit.checkpoint.inspect.describe import json_safe

        print(json.dumps(json_safe(data), indent=1, default=str, allow_nan=False))
    else:
        print("\n".join(printable(line) for line in text))


@contextlib.contextmanager
def about(path: Path | str) -> Iterator[None]:
    """An OSError that names no file is about `path`: say so ("Permission denied" alone names nothing)."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.strerror is not None:  # an errno error; not a CheckpointTimeoutError
            e.filename = str(path)
        raise


def url_kind(kind: str) -> str:
    """A bucket checkpoint's kind under the name a local one of that kind has."""
    from xlakit.checkpoint.inspect import describe
    from xlakit.checkpoint.inspect import bucket_describe

    return {bucket_describe.FILE: describe.XLAKIT_FILE}.get(kind, kind)


def read_state(path: str, *, with_kind: bool = False) -> Any:
    """The state of a checkpoint, verified: a local path or a URL of any kind (a step's included)."""
    from xlakit.checkpoint import objstore
    from xlakit.checkpoint.inspect import tensors

    if objstore.is_url(path):
        from xlakit.checkpoint.inspect import bucket_describe

        state, found = bucket_describe.read_state(path)
        kind = url_kind(found.kind)
    else:
        state, found = tensors.read_state(Path(path))
        kind = found.kind
    return (state, kind) if with_kind else state
