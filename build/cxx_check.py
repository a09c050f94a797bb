"""`make cxx-check`: compile the C++ against real XLA headers, and run it against a real PJRT client.

What is compiled (`-fsyntax-only`, which still instantiates templates), once per
bracket (the TensorFlow wheels whose XLA brackets the openxla pin, cxx_deps.py):

* every upstream file the patch series touches, first unpatched (the control),
  then patched. A patched file must compile wherever its control does; when the
  control fails too and the patched file adds no error of its own, the line says
  `drift` (the bracket moved away from the pin), not `error`;
* every file `place` puts into the tree (each .cc, and each header without a
  .cc of its own), which must compile on every bracket.

Files that need no upstream torch_xla file (the core, cache_entry.cc,
shard_layout.cc, memory_stats.cc, build_info.cc, cache_io.h) are compiled in a
tree holding only the placed files, so they are checked everywhere; the
upstream files and the adapters that include torch_xla headers need a torch_xla
source (--torch-xla-git / TORCH_XLA_GIT) and are reported `skip` without one.

Then tests/cxx is built with the placed XLA-only sources and linked against the
`link` bracket's TensorFlow libraries: pure-function tests, and the persistent
cache across two processes on the real CPU client (cold compile vs warm load).
Finally each deliberate break in BREAKS (a wrong PJRT signature, the friend
declaration removed) is compiled and must fail, so a check that cannot fail
fails loudly. Exit status 1 on any error. Results are kept by preprocessed
source (ResultCache, like ccache): a unit nothing reached is not compiled
again; --fresh compiles everything.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import cxx_deps
import pipeline
import series
from cxx_compile import Result, ResultCache, Toolchain, compile_one
from runner import Runner

TESTS = pipeline.ROOT / "tests" / "cxx"
# A touched upstream header is checked through the .cpp of the same stem, or
# through the file named here: the one that instantiates its templates.
HEADER_CONSUMERS = {"torch_xla/csrc/runtime/cache.h": "torch_xla/csrc/xla_graph_executor.cpp"}
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.M)


@dataclass(frozen=True)
class Unit:
    path: str  # in the torch_xla tree
    kind: str  # "upstream" (control + patched) or "xlakit"
    needs_tree: bool  # includes upstream torch_xla files


@dataclass(frozen=True)
class Break:
    """A deliberate mistake that must make `victim` fail to compile."""

    name: str
    edit_path: str
    old: str
    new: str
    victim: str
    expect: str  # a phrase of the compiler's error
    needs_tree: bool


BREAKS = [
    Break("wrong PJRT signature in a copy of cache_entry.cc", "torch_xla/csrc/runtime/xlakit/cache_entry.cc",
          "client.LoadSerializedExecutable(payload, std::nullopt,\n                                      "
          "xla::LoadOptions())",
          "client.LoadSerializedExecutable(payload, xla::LoadOptions())",
          "torch_xla/csrc/runtime/xlakit/cache_entry.cc", "no matching function", needs_tree=False),
    Break("friend declaration removed from a copy of the patched client header",
          "torch_xla/csrc/runtime/pjrt_computation_client.h", "  friend class xlakit::PjRtAccess;\n", "",
          "torch_xla/csrc/runtime/xlakit/pjrt_access.cc", "private within this context", needs_tree=True),
]


def tree_path(placed: Path) -> str:
    """A csrc/ file's path once placed into the torch_xla tree."""
    rel = placed.relative_to(pipeline.CSRC)
    return f"{pipeline.PLACEMENT[rel.parts[0]]}/{'/'.join(rel.parts[1:])}"


def _placed_sources() -> dict[str, Path]:
    return {tree_path(f): f for f in pipeline.placed_files()}


def needs_tree(path: str, placed: dict[str, Path]) -> bool:
    """Whether a placed file includes, directly or through placed headers, an upstream torch_xla file."""
    seen, todo = set(), [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for inc in _INCLUDE.findall(placed[current].read_text()):
            if inc in placed:
                todo.append(inc)
            elif inc.startswith("torch_xla/") and inc != pipeline.STAMP_TARGET:
                return True
    return False


def xlakit_units() -> list[Unit]:
    placed = _placed_sources()
    sources = {p.rsplit(".", 1)[0] for p in placed if p.endswith(".cc")}
    units = [p for p in placed if p.endswith(".cc") or p.rsplit(".", 1)[0] not in sources]
    return [Unit(p, "xlakit", needs_tree(p, placed)) for p in sorted(units)]


def touched_files(patches: list[series.Patch]) -> list[str]:
    files = []
    for p in patches:
        for m in re.finditer(r"^diff --git a/(\S+) b/", p.path.read_text(), re.M):
            if m.group(1) not in files:
                files.append(m.group(1))
    return files


def upstream_units(patches: list[series.Patch], tree: Path | None) -> list[Unit]:
    """The upstream translation units that see what the series changes."""
    out: list[str] = []
    for f in touched_files(patches):
        if f.endswith((".cpp", ".cc")):
            unit = f
        elif f.endswith(".h"):
            stem = f[: -len(".h")] + ".cpp"
            unit = HEADER_CONSUMERS.get(f, stem)
            if tree is not None and tree.exists() and not (tree / unit).exists():
                raise series.SeriesError(f"the series touches {f}, but {unit} does not exist: name the .cpp "
                                         f"that instantiates it in cxx_check.HEADER_CONSUMERS")
        else:
            continue  # BUILD files: bazel's business
        if unit not in out:
            out.append(unit)
    return [Unit(u, "upstream", True) for u in out]


def classify(control: Result | None, patched: Result) -> str:
    """ok / drift / error for one unit on one bracket (control is None for xlakit's own files)."""
    if patched.ok:
        return "ok"
    if control is None or control.ok:
        return "error"
    # Both fail: drift, unless the patched file fails in a way the control does not.
    return "drift" if set(patched.errors) <= set(control.errors) else "error"


def minimal_tree(runner: Runner, cfg: pipeline.Config, dest: Path) -> Path:
    """Only the placed files and the stamp: enough for the XLA-only units, no upstream source."""
    runner.run(["rm", "-rf", str(dest)])
    pipeline.place(runner, dest)
    pipeline.write_stamp(runner, cfg, dest)
    return dest


def patched_tree(runner: Runner, cfg: pipeline.Config, pristine: Path, dest: Path) -> Path:
    runner.run(["rm", "-rf", str(dest)])
    runner.run(["cp", "-R", str(pristine), str(dest)])
    commit = cfg.sources()["torch_xla"].commit
    series.check_and_apply(runner, dest, series.read(), commit)
    pipeline.place(runner, dest)
    pipeline.stamp(runner, cfg, dest)
    return dest


def broken_copy(runner: Runner, tree: Path, brk: Break, dest: Path) -> Path:
    """A copy of `tree` with the deliberate mistake in it; the mistake's text must still be there."""
    runner.run(["rm", "-rf", str(dest)])
    runner.run(["cp", "-R", str(tree), str(dest)])
    runner.note(f"break {brk.edit_path}: replace {brk.old.strip()!r} with {brk.new.strip()!r}")
    if not runner.dry_run:
        target = dest / brk.edit_path
        text = target.read_text()
        if brk.old not in text:
            raise pipeline.StepError(f"the deliberate break '{brk.name}' no longer finds its text in "
                                     f"{brk.edit_path}; update cxx_check.BREAKS with the code")
        target.write_text(text.replace(brk.old, brk.new, 1))
    return dest


def xla_only_sources(units: list[Unit], tree: Path) -> list[Path]:
    """The placed .cc files the C++ test links: those needing neither torch_xla nor torch/pybind11."""
    placed = _placed_sources()
    out = []
    for u in units:
        if u.needs_tree or not u.path.endswith(".cc"):
            continue
        includes = _INCLUDE.findall(placed[u.path].read_text())
        if not any(i.startswith(("torch/", "ATen/", "pybind11/")) for i in includes):
            out.append(tree / u.path)
    return out


def object_cmds(tc: Toolchain, tree: Path, bracket: cxx_deps.Bracket, sources: list[Path],
                out: Path) -> list[tuple[Path, list[str]]]:
    """The C++ test's objects: the placed XLA-only sources and tests/cxx."""
    srcs = sources + sorted(TESTS.glob("*.cc"))
    return [(out / f"{s.name}.o",
             [tc.cxx, *tc.flags(tree, bracket), f"-I{TESTS}", "-O1", "-c", str(s), "-o", str(out / f"{s.name}.o")])
            for s in srcs]


def link_test(runner: Runner, tc: Toolchain, bracket: cxx_deps.Bracket, objects: list[Path],
              out: Path) -> tuple[bool, str]:
    """One link against the bracket's TensorFlow libraries (their XLA symbols)."""
    exe = out / "xlakit_cxx_test"
    cmd = [tc.cxx, "-o", str(exe), *map(str, objects), *map(str, bracket.libraries),
           f"-Wl,-rpath,{bracket.root}", "-lpthread"]
    r = compile_one(runner, cmd)
    return r.ok, str(exe) if r.ok else f"link: {r.errors[0]}"


# The job's key for the keyed half of the cache test; a test value, not a secret.
TEST_CACHE_KEY = "xlakit-cxx-check-test-key-0123456789abcdef"


def run_test(runner: Runner, exe: str, scratch: Path) -> tuple[bool, list[str]]:
    """units, then the cache written by one process and loaded by another (as jobs with and without a key)."""
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "XLAKIT_CACHE_KEY": TEST_CACHE_KEY}
    lines, ok = [], True
    runner.run(["rm", "-rf", str(scratch)])
    runner.run(["mkdir", "-p", str(scratch / "units"), str(scratch / "cache")])
    for mode, folder in (("units", "units"), ("write", "cache"), ("load", "cache")):
        cmd = [exe, mode, str(scratch / folder)]
        if runner.dry_run:
            runner.run(cmd, env=env)
            continue
        r = runner.capture(cmd, check=False, env=env, timeout_s=600)
        lines += [line for line in r.stdout.splitlines() if line.strip()]
        if r.returncode != 0:
            ok = False
            lines.append(f"{mode} exited with {r.returncode}: {r.stderr.strip()[-600:]}")
            break
    return ok, lines


def line(bracket: str, what: str, path: str, verdict: str, detail: str = "") -> str:
    return f"cxx-check {bracket:<8} {what:<9} {path:<58} {verdict}{'  ' + detail if detail else ''}"


def _seconds(*results: Result | None) -> str:
    done = [r for r in results if r]
    cached = sum(r.cached for r in done)
    note = "" if not cached else " (cached)" if cached == len(done) else f" ({cached} of {len(done)} cached)"
    return f"{sum(r.seconds for r in done):.0f} s{note}"


def run(runner: Runner, cfg: pipeline.Config, *, cache: Path, python: str, torch_xla_git: str | None,
        jobs: int, bracket_names: list[str] | None, cxx: str, out, fresh: bool = False) -> int:
    start = time.monotonic()
    log = runner  # commands go to the runner's log; verdicts to `out`

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    brackets = cxx_deps.brackets(log, cache, bracket_names)
    llvm = cxx_deps.llvm(log, cache)
    torch = cxx_deps.torch(log, python)
    work = cfg.work / "cxx-check"
    commit = cfg.sources()["torch_xla"].commit
    pristine = cxx_deps.torch_xla_tree(log, cache, torch_xla_git, commit) if torch_xla_git else None
    gen = cxx_deps.codegen(log, cache, pristine, commit, torch) if pristine else None
    tc = Toolchain(cxx=cxx, torch=torch, llvm=llvm, gen=gen)
    results = ResultCache(log, None if fresh else cache / "results", cxx)
    minimal = minimal_tree(log, cfg, work / "placed")
    patched = patched_tree(log, cfg, pristine, work / "patched") if pristine else None

    patches = series.read()
    units = upstream_units(patches, pristine) + xlakit_units()
    counts = {"ok": 0, "drift": 0, "error": 0, "skip": 0}
    no_tree = "no torch_xla source: set TORCH_XLA_GIT to a torch_xla git URL or mirror"

    def check(bracket: cxx_deps.Bracket, unit: Unit) -> tuple[str, str]:
        if unit.needs_tree and patched is None:
            return "skip", no_tree
        if unit.kind == "xlakit":
            r = results.compile(tc.syntax_cmd(patched or minimal, bracket, unit.path))
            verdict = classify(None, r)
            return verdict, _seconds(r) if r.ok else f"{len(r.errors)} errors, first: {r.errors[0]}"
        control = results.compile(tc.syntax_cmd(pristine, bracket, unit.path))
        mine = results.compile(tc.syntax_cmd(patched, bracket, unit.path))
        verdict = classify(control, mine)
        if verdict == "ok":
            return verdict, f"control ok, {_seconds(control, mine)}"
        if verdict == "drift":
            return verdict, (f"the unpatched file fails here too ({len(control.errors)} errors, first: "
                             f"{control.errors[0]}); the patches add none")
        new = [e for e in mine.errors if e not in control.errors] or mine.errors
        return verdict, f"control {'ok' if control.ok else 'fails'}; patched: {len(new)} errors, first: {new[0]}"

    def selftest(brk: Break) -> tuple[str, str]:
        bracket = brackets[0]
        if brk.needs_tree and patched is None:
            return "skip", no_tree
        copy = broken_copy(log, patched if brk.needs_tree else minimal, brk,
                           work / f"break-{BREAKS.index(brk)}")
        r = results.compile(tc.syntax_cmd(copy, bracket, brk.victim))
        if runner.dry_run:
            return "ok", "dry run"
        hit = [e for e in r.errors if brk.expect in e]
        if not r.ok and hit:
            return "ok", f"fails as it must: {hit[0]}"
        return "error", ("compiled: the check cannot catch this break" if r.ok
                         else f"failed without '{brk.expect}': {r.errors[0]}")

    link = next(b for b in brackets if b.pin.link) if any(b.pin.link for b in brackets) else None
    test_dir = work / "test"
    objects = object_cmds(tc, minimal, link, xla_only_sources(xlakit_units(), minimal), test_dir) if link else []
    log.run(["mkdir", "-p", str(test_dir)])
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        # Heavy upstream units first, so the pool stays full to the end.
        order = sorted(units, key=lambda u: u.kind != "upstream")
        futures = [(b, u, pool.submit(check, b, u)) for u in order[:1] for b in brackets]
        built = [(obj, pool.submit(results.compile, cmd)) for obj, cmd in objects]
        futures += [(b, u, pool.submit(check, b, u)) for u in order[1:] for b in brackets]
        breaks = [(brk, pool.submit(selftest, brk)) for brk in BREAKS]
        for b, u, f in futures:
            verdict, detail = f.result()
            counts[verdict] += 1
            say(line(b.name, u.kind, u.path, verdict, detail))
        for brk, f in breaks:
            verdict, detail = f.result()
            counts[verdict] += 1
            say(line(brackets[0].name, "selftest", brk.name, verdict, detail))
        failed = [(obj, f.result()) for obj, f in built if not f.result().ok]
    if link is not None:
        if failed:
            ok, lines = False, [f"{obj.name}: {r.errors[0]}" for obj, r in failed[:3]]
        else:
            ok, exe = link_test(log, tc, link, [obj for obj, _ in objects], test_dir)
            ok, lines = run_test(log, exe, work / "test-run") if ok else (False, [exe])
        for text in lines:
            say(line(link.name, "test", "tests/cxx", "ok" if ok else "error", text))
        counts["ok" if ok else "error"] += 1
    say(f"cxx-check: {counts['ok']} ok, {counts['drift']} drift, {counts['error']} error, {counts['skip']} skip "
        f"on brackets {', '.join(f'{b.name}={b.pin.package} {b.pin.version}' for b in brackets)} "
        f"in {time.monotonic() - start:.0f} s")
    return 1 if counts["error"] else 0
