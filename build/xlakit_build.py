#!/usr/bin/env python3
"""xlakit's build CLI: one entry point, a subcommand per step.

Makefile targets only call this. Every external command goes through one
runner that logs it, so `--dry-run` prints the whole pipeline in order.
`build` is the full source build (preflight, fetch, verify, patch, place,
stamp, torch wheel, patched torch_xla wheel, xlakit wheel, SHA256SUMS +
build-info.json); the other subcommands are its steps, runnable alone.
`cxx-check` compiles the C++ against real XLA headers and runs it against a
real PJRT client without bazel (cxx_check.py). `wheel` is xlakit's release
(sdist + manylinux wheel, wheel.py), `wheel-check` judges every wheel's tag
with auditwheel, `wheelhouse` downloads what the installed-wheel test
installs offline.
Git sources default to VERSIONS.toml and are overridden by --pytorch-git /
--torch-xla-git (the Makefile passes PYTORCH_GIT / TORCH_XLA_GIT), e.g. to a
local mirror on an air-gapped host.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cxx_check  # noqa: E402
import cxx_compile  # noqa: E402
import cxx_deps  # noqa: E402
import pins  # noqa: E402
import pipeline  # noqa: E402
import preflight  # noqa: E402
import series  # noqa: E402
import wheel  # noqa: E402
from runner import CommandError, Runner  # noqa: E402

ROOT = pipeline.ROOT


def _config(args: argparse.Namespace) -> pipeline.Config:
    urls = {"pytorch": getattr(args, "pytorch_git", None), "torch_xla": getattr(args, "torch_xla_git", None)}
    return pipeline.Config(work=Path(args.work).resolve(), wheels=Path(args.wheels).resolve(),
                           git_urls={k: v for k, v in urls.items() if v})


def cmd_requirements(args: argparse.Namespace) -> int:
    if args.no_deps:
        print("\n".join(pins.requirements(args.profile, no_deps=True)))
        return 0
    tools = pins.test_tool_requirements() + pins.wheel_tool_requirements() if args.test_tools else []
    lines = pins.requirements(args.profile) + tools
    print("\n".join(lines))
    return 0


def cmd_export_series(args: argparse.Namespace) -> int:
    patches = series.export(Runner(), Path(args.repo), args.base)
    print(f"wrote {len(patches)} patches and patches/series (sha256 {series.sha256(patches)})")
    return 0


def cmd_preflight(args: argparse.Namespace) -> int:
    cfg = _config(args)
    tree_version = cfg.torch_xla_dir / ".bazelversion"
    want = tree_version.read_text().strip() if tree_version.exists() else preflight.FALLBACK_BAZEL_VERSION
    urls = {name: cfg.url(name) for name in ("pytorch", "torch_xla")}
    ok = preflight.report(preflight.run(Runner(), work=cfg.work, bazel_version=want, sources=urls), sys.stdout)
    return 0 if ok else 1


def cmd_patches_check(args: argparse.Namespace) -> int:
    """Pinned torch_xla in a temporary tree + the whole series, zero fuzz."""
    cfg = _config(args)
    runner = Runner(dry_run=args.dry_run)
    commit = cfg.sources()["torch_xla"].commit
    patches = series.read()
    # Under --work, not /tmp: a torch_xla checkout is large and callers
    # (tests, CI) choose where scratch space lives.
    if not args.dry_run:
        cfg.work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="patches-check-", dir=cfg.work if cfg.work.exists() else None) as tmp:
        tree = Path(tmp) / "torch_xla"
        pipeline.fetch(runner, cfg.url("torch_xla"), commit, tree)
        pipeline.verify(runner, cfg, tree, with_pytorch=False)
        series.check_and_apply(runner, tree, patches, commit)
        pipeline.place(runner, tree)
        pipeline.stamp(runner, cfg, tree)
    print(f"patches-check: {len(patches)} patches apply with zero fuzz to torch_xla {commit[:12]} "
          f"(series sha256 {series.sha256(patches)[:16]})")
    return 0


def cmd_cxx_check(args: argparse.Namespace) -> int:
    """Compile checks on both brackets, the C++ test, the deliberate breaks; verdicts on stdout."""
    cfg = _config(args)
    # Only a source given explicitly: CI has no route to the default GitHub URL.
    git = args.torch_xla_git or os.environ.get("XLAKIT_TORCH_XLA_GIT") or None
    log_path = cfg.work / "cxx-check" / "commands.log"
    with contextlib.ExitStack() as stack:
        if args.dry_run:
            out = sys.stdout
        else:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            out = stack.enter_context(open(log_path, "w"))
            print(f"cxx-check: every command is logged to {log_path}", flush=True)
        runner = Runner(dry_run=args.dry_run, out=out)
        return cxx_check.run(runner, cfg, cache=cxx_deps.cache_root(args.cache), python=args.python,
                             torch_xla_git=git, jobs=args.jobs, cxx=cxx_compile.which_cxx(args.cxx),
                             bracket_names=args.brackets.split(",") if args.brackets else None, out=sys.stdout,
                             fresh=args.fresh)


def _build_steps(runner: Runner, cfg: pipeline.Config) -> dict:
    src = cfg.sources()
    patches = series.read()
    dist = cfg.work / "dist"
    pipeline.fetch(runner, cfg.url("pytorch"), src["pytorch"].commit, cfg.pytorch_dir, submodules=True)
    pipeline.fetch(runner, cfg.url("torch_xla"), src["torch_xla"].commit, cfg.torch_xla_dir)
    pipeline.verify(runner, cfg, cfg.torch_xla_dir)
    series.check_and_apply(runner, cfg.torch_xla_dir, patches, src["torch_xla"].commit)
    pipeline.place(runner, cfg.torch_xla_dir)
    pipeline.stamp(runner, cfg, cfg.torch_xla_dir)
    runner.run(["mkdir", "-p", str(dist), str(cfg.wheels)])
    # A build venv: torch_xla's build installs torch, which must not land in
    # whatever interpreter ran this script.
    venv = cfg.work / "venv"
    py = str(venv / "bin" / "python")
    runner.run([cfg.python, "-m", "venv", str(venv)])
    runner.run([py, "-m", "pip", "install", "-r", "requirements.txt"], cwd=cfg.pytorch_dir)
    runner.run([py, "setup.py", "bdist_wheel", "-d", str(dist)], cwd=cfg.pytorch_dir,
               env={"USE_CUDA": "0", "BUILD_TEST": "0", "PYTORCH_BUILD_VERSION": src["pytorch"].version,
                    "PYTORCH_BUILD_NUMBER": "1"})
    # torch_xla's setup.py imports torch: install the wheel just built.
    runner.run([py, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--no-index", "--find-links", str(dist),
                f"torch=={src['pytorch'].version}"])
    runner.run([py, "setup.py", "bdist_wheel", "-d", str(dist)], cwd=cfg.torch_xla_dir,
               env={"TORCH_XLA_VERSION": cfg.local_version(), "GIT_VERSIONED_XLA_BUILD": "FALSE",
                    "BUILD_CPP_TESTS": "0"})
    runner.run(["find", str(dist), "-maxdepth", "1", "(", "-name", "torch-*.whl", "-o", "-name", "torch_xla-*.whl",
                ")", "-exec", "cp", "{}", str(cfg.wheels), ";"])
    return _xlakit_wheel(runner, cfg)


def _xlakit_wheel(runner: Runner, cfg: pipeline.Config) -> dict:
    """The sdist and the manylinux wheel into wheels/ (replacing earlier xlakit ones); build-info's record."""
    sdist, built = wheel.build(runner, cfg.work / "xlakit-wheel", cfg.python)
    tag = wheel.audit(runner, built, wheel.floor()) if not runner.dry_run else "<auditwheel show>"
    earlier = [*cfg.wheels.glob("xlakit-*.whl"), *cfg.wheels.glob("xlakit-*.tar.gz")]
    if earlier:
        runner.run(["rm", "-f", *map(str, earlier)])
    runner.run(["cp", str(sdist), str(built), str(cfg.wheels)])
    return {} if runner.dry_run else wheel.record(cfg.wheels / sdist.name, cfg.wheels / built.name, tag, cfg.python)


def cmd_build(args: argparse.Namespace) -> int:
    cfg = _config(args)
    runner = Runner(dry_run=args.dry_run)
    if not args.force and not args.dry_run and pipeline.up_to_date(cfg):
        print(f"build: inputs unchanged since {cfg.wheels / 'build-info.json'}; nothing to do (--force rebuilds)")
        return 0
    runner.run([cfg.python, str(Path(__file__).resolve()), "preflight", "--work", str(cfg.work),
                *(f"--{k.replace('_', '-')}-git={v}" for k, v in cfg.git_urls.items())])
    xlakit = _build_steps(runner, cfg)
    runner.note(f"write {cfg.wheels}/SHA256SUMS and build-info.json")
    if not args.dry_run:
        pipeline.write_sums(cfg.wheels, {**pipeline.build_info(cfg), "inputs_sha256": pipeline.inputs_digest(),
                                         "xlakit": xlakit})
    return 0


def cmd_wheel(args: argparse.Namespace) -> int:
    cfg = _config(args)
    runner = Runner(dry_run=args.dry_run)
    runner.run(["mkdir", "-p", str(cfg.wheels)])
    xlakit = _xlakit_wheel(runner, cfg)
    runner.note(f"write {cfg.wheels}/SHA256SUMS and build-info.json")
    if not args.dry_run:
        # A source build's record (`make build`) stays; the xlakit part is this build's.
        pipeline.write_sums(cfg.wheels, {**pipeline.read_info(cfg.wheels), "xlakit": xlakit})
        print(f"wheel: {cfg.wheels / xlakit['wheel']} ({xlakit['auditwheel']}), {xlakit['sources']['sdist']}")
    return 0


def cmd_wheel_check(args: argparse.Namespace) -> int:
    wheel.check(Runner(), Path(args.wheels).resolve())
    return 0


def cmd_wheelhouse(args: argparse.Namespace) -> int:
    """What the installed-wheel test installs with --no-index: the cpu-dev stack, the stand-in libtpu, and
    xlakit's own dependencies for every Python the wheel is proven on."""
    runner = Runner(dry_run=args.dry_run)
    dest = str(Path(args.dest).resolve())
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    stand_in = [r for r in pins.test_tool_requirements() if r.startswith("xla-cpu-pjrt==")]
    download = [args.python, "-m", "pip", "download", "--only-binary=:all:", "--dest", dest]
    runner.run([*download, *pins.requirements("cpu-dev"), *stand_in, *deps])
    for version in pins.wheel_pythons():
        runner.run([*download, "--python-version", version, *deps])
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    cfg = _config(args)
    runner = Runner(dry_run=args.dry_run)
    sums = pipeline.verify_sums(cfg.wheels)
    # pip re-checks every hash itself (--require-hashes), so a wheel swapped
    # after our check still fails the install.
    reqs = cfg.work / "install-requirements.txt"
    reqs.parent.mkdir(parents=True, exist_ok=True)
    # The wheels only: the sdist beside them is for those who build from source.
    reqs.write_text("".join(f"{(cfg.wheels / n).as_uri()} --hash=sha256:{d}\n" for n, d in sorted(sums.items())
                            if n.endswith(".whl")))
    runner.run([args.python, "-m", "pip", "install", "--no-deps", "--require-hashes", "-r", str(reqs)])
    return 0


def cmd_step(args: argparse.Namespace) -> int:
    """fetch / verify / patch / place / stamp on the work tree, one at a time."""
    cfg = _config(args)
    runner = Runner(dry_run=args.dry_run)
    src = cfg.sources()
    if args.command == "fetch":
        pipeline.fetch(runner, cfg.url("pytorch"), src["pytorch"].commit, cfg.pytorch_dir, submodules=True)
        pipeline.fetch(runner, cfg.url("torch_xla"), src["torch_xla"].commit, cfg.torch_xla_dir)
    elif args.command == "verify":
        pipeline.verify(runner, cfg, cfg.torch_xla_dir, with_pytorch=cfg.pytorch_dir.joinpath(".git").exists())
    elif args.command == "patch":
        series.check_and_apply(runner, cfg.torch_xla_dir, series.read(), src["torch_xla"].commit)
    elif args.command == "place":
        pipeline.place(runner, cfg.torch_xla_dir)
    elif args.command == "stamp":
        pipeline.stamp(runner, cfg, cfg.torch_xla_dir)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xlakit_build", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("requirements", help="print pip requirement lines for a profile")
    r.add_argument("--profile", default="cpu-dev")
    r.add_argument("--test-tools", action="store_true",
                   help="add the PJRT wrapper's test plugins and framework (VERSIONS.toml [pjrt_wrap.test_packages])")
    r.add_argument("--no-deps", action="store_true",
                   help="only the profile's `no_deps` packages, for a second `pip install --no-deps`")
    r.set_defaults(func=cmd_requirements)
    e = sub.add_parser("export-series", help="rewrite patches/ from a branch of torch_xla commits")
    e.add_argument("--repo", required=True, help="torch_xla checkout whose HEAD carries the patches")
    e.add_argument("--base", default=pins.sources("tpu")["torch_xla"].commit)
    e.set_defaults(func=cmd_export_series)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--work", default=str(ROOT / "build" / "_out" / "work"), help="checkouts and dist/")
        q.add_argument("--wheels", default=str(ROOT / "wheels"))
        q.add_argument("--pytorch-git", default=os.environ.get("PYTORCH_GIT") or None)
        q.add_argument("--torch-xla-git", default=os.environ.get("TORCH_XLA_GIT") or None)
        q.add_argument("--dry-run", action="store_true", help="print every command, run none")

    for name, func, help_text in (
        ("preflight", cmd_preflight, "name what this host lacks for a source build"),
        ("patches-check", cmd_patches_check, "apply the series to the pinned torch_xla in a temp tree"),
        ("cxx-check", cmd_cxx_check, "compile the C++ against real XLA headers; run it on a real PJRT client"),
        ("build", cmd_build, "the full source build into wheels/"),
        ("wheel", cmd_wheel, "build the xlakit sdist and manylinux wheel into wheels/"),
        ("wheel-check", cmd_wheel_check, "auditwheel show on every wheel in wheels/; fail on a tag past the floor"),
        ("wheelhouse", cmd_wheelhouse, "download what the installed-wheel test installs offline"),
        ("install", cmd_install, "install wheels/ after checking SHA256SUMS"),
        ("fetch", cmd_step, "fetch pytorch and torch_xla at the pins"),
        ("verify", cmd_step, "check the checkouts against VERSIONS.toml"),
        ("patch", cmd_step, "check, then apply the series to the torch_xla checkout"),
        ("place", cmd_step, "copy csrc/ into the torch_xla checkout"),
        ("stamp", cmd_step, "write the provenance header into the torch_xla checkout"),
    ):
        q = sub.add_parser(name, help=help_text)
        common(q)
        q.set_defaults(func=func)
        if name == "build":
            q.add_argument("--force", action="store_true", help="rebuild even if inputs are unchanged")
        if name == "install":
            q.add_argument("--python", default=sys.executable, help="interpreter whose environment gets the wheels")
        if name == "wheelhouse":
            q.add_argument("--dest", default=str(ROOT / "build" / "_out" / "wheelhouse"), help="folder of wheels")
            q.add_argument("--python", default=sys.executable, help="interpreter whose tags to download for")
        if name == "cxx-check":
            q.add_argument("--python", default=sys.executable, help="interpreter with the cpu-dev torch (headers)")
            q.add_argument("--cache", default=None, help="download cache [$XLAKIT_CXX_CACHE or ~/.cache/xlakit/cxx]")
            q.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel compiles")
            q.add_argument("--brackets", default=None, help="comma-separated bracket names (default: all)")
            q.add_argument("--cxx", default=None, help="C++ compiler [g++]")
            q.add_argument("--fresh", action="store_true", help="compile every unit, ignoring kept results")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (pins.PinError, series.SeriesError, pipeline.StepError, CommandError, cxx_deps.DepsError) as e:
        print(f"xlakit_build {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
