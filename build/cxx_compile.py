"""How `make cxx-check` compiles one translation unit, and keeps its result.

A Toolchain turns (tree, bracket, file) into a g++ command with the include
order the real headers need; compile_one runs it through the logging runner
and reads the errors out of gcc's output; ResultCache keeps results (and
objects) by compiler, flags and preprocessed source, so an unchanged unit is
not compiled again.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import cxx_deps
import pipeline
from runner import Runner

SHIMS = pipeline.ROOT / "build" / "cxx_shims"
STD_FLAGS = ["-std=c++17", "-fexceptions", "-D_GLIBCXX_USE_CXX11_ABI=1"]
COMPILE_TIMEOUT_S = 900
_ERROR = re.compile(r"(?:^|: )(?:fatal )?error: (.*)$", re.M)


@dataclass
class Result:
    rc: int
    seconds: float
    errors: list[str] = field(default_factory=list)
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.rc == 0


def errors_of(output: str) -> list[str]:
    return [m.strip() for m in _ERROR.findall(output)]


@dataclass(frozen=True)
class Toolchain:
    """Everything a compile command needs apart from the tree."""

    cxx: str
    torch: cxx_deps.Torch
    llvm: list[Path]
    gen: Path | None

    def flags(self, tree: Path, bracket: cxx_deps.Bracket) -> list[str]:
        # Order matters: the TF include dir before torch's (torch ships older
        # protobuf headers); the shims last, so a wheel that ships the real
        # header wins over the stand-in. BoringSSL's headers (the runtime's
        # crypto, @boringssl//:crypto) come before the system's OpenSSL.
        inc = bracket.include
        systems = [inc, *self.torch.includes, inc / "external/boringssl/src/include",
                   inc / "external/llvm-project/mlir/include", *self.llvm,
                   inc / "external/stablehlo", inc / "external/highwayhash", inc / "external/farmhash_archive/src",
                   inc / "external/com_github_grpc_grpc/include", inc / "ml_dtypes/include", self.torch.python_include]
        flags = [*STD_FLAGS, f"-I{tree}"] + ([f"-I{self.gen}"] if self.gen else [])
        return flags + [f"-isystem{p}" for p in systems] + [f"-idirafter{SHIMS}"]

    def syntax_cmd(self, tree: Path, bracket: cxx_deps.Bracket, path: str) -> list[str]:
        lang = ["-x", "c++"] if path.endswith(".h") else []
        return [self.cxx, *self.flags(tree, bracket), "-fsyntax-only", *lang, str(tree / path)]


def compile_one(runner: Runner, cmd: list[str]) -> Result:
    start = time.monotonic()
    if runner.dry_run:
        runner.run(cmd)  # prints it, runs nothing
        return Result(0, 0.0)
    r = runner.capture(cmd, check=False, timeout_s=COMPILE_TIMEOUT_S)
    output = r.stdout + r.stderr
    return Result(r.returncode, time.monotonic() - start, errors_of(output) or [output.strip()[-300:]])


class ResultCache:
    """Compile results keyed by the compiler, the flags and the preprocessed source, as ccache
    keys objects: diagnostics and objects depend on nothing else, so a translation unit whose
    preprocessed text is unchanged (an unpatched control, a file no edit reached) is not compiled
    again. Preprocessing costs a few seconds where compiling costs a minute or two."""

    def __init__(self, runner: Runner, folder: Path | None, cxx: str):
        self.runner = runner
        self.folder = folder
        self.compiler = ""
        if folder is not None and not runner.dry_run:
            folder.mkdir(parents=True, exist_ok=True)
            self.compiler = runner.capture([cxx, "--version"], check=False).stdout.splitlines()[0:1]

    def _key(self, cmd: list[str]) -> str | None:
        out = cmd[cmd.index("-o") + 1] if "-o" in cmd else None
        pre = [c for i, c in enumerate(cmd) if c not in ("-fsyntax-only", "-c") and c != out and
               not (c == "-o" and cmd[i + 1] == out)] + ["-E"]
        r = self.runner.capture(pre, check=False, timeout_s=COMPILE_TIMEOUT_S)
        if r.returncode != 0:
            return None  # the compile itself will say why
        h = hashlib.sha256(json.dumps([self.compiler, [c for c in cmd if c != out]]).encode())
        h.update(r.stdout.encode())
        return h.hexdigest()

    def compile(self, cmd: list[str]) -> Result:
        if self.folder is None or self.runner.dry_run:
            return compile_one(self.runner, cmd)
        start = time.monotonic()
        key = self._key(cmd)
        record = self.folder / f"{key}.json"
        out = Path(cmd[cmd.index("-o") + 1]) if "-o" in cmd else None
        stored_obj = self.folder / f"{key}.o"
        if key and record.exists() and (out is None or stored_obj.exists()):
            found = json.loads(record.read_text())
            if out is not None:
                shutil.copyfile(stored_obj, out)
            return Result(found["rc"], time.monotonic() - start, found["errors"], cached=True)
        result = compile_one(self.runner, cmd)
        # A timeout or a missing compiler says nothing about the source: not kept.
        if key and result.rc not in (124, 127):
            if out is not None and result.ok:
                shutil.copyfile(out, stored_obj.with_suffix(".o.partial"))
                stored_obj.with_suffix(".o.partial").replace(stored_obj)
            partial = record.with_suffix(".json.partial")
            partial.write_text(json.dumps({"rc": result.rc, "errors": result.errors}))
            partial.replace(record)
        return result


def which_cxx(explicit: str | None) -> str:
    cxx = explicit or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise pipeline.StepError("no C++ compiler: expected g++ or c++ on PATH (or pass --cxx)")
    return cxx
