"""Part of `make bench`: the compile cache's shared tier, a recreated VM's first step, and entry sizes.

Rows, each a fresh process running stock torch_xla 2.9 on OpenXLA's
xla-cpu-pjrt plugin through xlakit's PJRT wrapper (the deep-MLP training step
of bench_compile.py), the shared tier on a real fake-gcs-server on 127.0.0.1:

* `cold`: an empty bucket prefix and an empty local folder: every program
  compiles, and is published at the clean exit;
* `recreated VM`: an empty local folder (a new disk), the shared tier warm:
  every program is pulled (the bytes downloaded are shown) and hits;
* `warm local folder`: the same VM restarted, its folder kept: no download.

Then the entry size of one program against JAX's own persistent cache: the
jitted chain of bench_compile.py on lammps-jax-pjrt-cpu, once through the
wrapper (its local entry, and the compressed object the shared tier stores)
and once with JAX's compilation cache on the plugin alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import measure  # noqa: E402

KEY = "bench-" + "k" * 40


def one(mode: str) -> None:
    """In a fresh process: one torch_xla step (or the jax chain for `jax-*`), its numbers as JSON."""
    import bench_compile

    if mode == "jax-wrapper":
        bench_compile.jax_program(True)
        print(json.dumps({}), flush=True)
        return
    if mode == "jax-own-cache":
        import jax

        jax.config.update("jax_compilation_cache_dir", os.environ["BENCH_JAX_CACHE"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        bench_compile.jax_program(False, own_cache=True)
        print(json.dumps({}), flush=True)
        return
    start = time.perf_counter()
    row = bench_compile.torch_xla_program()
    row["to_first_result_s"] = time.perf_counter() - start  # the pull included
    from xlakit import cache_tier
    from xlakit.runtime import pjrt_wrap

    counts = pjrt_wrap.status().get("counts", {})
    pull = cache_tier.active().last_pull
    row.update(hits=counts.get("hits", 0), misses=counts.get("misses", 0), compile_s=counts.get("compile_s", 0.0),
               load_s=counts.get("load_s", 0.0), pulled=pull.moved,
               downloaded=pull.bytes_moved, pull_s=pull.seconds)
    print(json.dumps(row), flush=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        one(sys.argv[2])
        return 0
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    from tests.support.objstore_servers import Server

    with tempfile.TemporaryDirectory(prefix="xlakit-bench-tier-") as keep:
        keep = Path(keep)
        server = Server("gs", keep / "server")
        try:
            os.environ.update(server.env())
            os.environ.update(XLAKIT_CACHE_KEY=KEY, BENCH_CACHE_ROOT=f"{server.bucket()}/xla-cache")
            os.environ.pop("XLAKIT_PJRT_CACHE_DIR", None)
            print("compile cache shared tier (fake-gcs-server on 127.0.0.1): torch_xla deep-MLP step, one run each")
            print(f"{'start':34} {'process to result s':>19} {'first step s':>12} {'compile s':>9} {'load s':>7} "
                  f"{'pull s':>7} {'pulled':>6} {'downloaded B':>12} {'hits':>5} {'misses':>6}")
            rows = {}
            for label, home in (("cold (empty bucket, empty disk)", "vm1"),
                                ("recreated VM (empty disk)", "vm2"), ("warm local folder (same VM)", "vm2")):
                (keep / home).mkdir(mode=0o700, exist_ok=True)
                os.environ["XDG_CACHE_HOME"] = str(keep / home)
                r = rows[label] = measure.fresh_process(__file__, ["tier"])
                print(f"{label:34} {r['to_first_result_s']:19.2f} {r['first_call_s']:12.2f} {r['compile_s']:9.2f} "
                      f"{r['load_s']:7.3f} {r['pull_s']:7.2f} {r['pulled']:6d} {r['downloaded']:12d} {r['hits']:5d} "
                      f"{r['misses']:6d}", flush=True)
            cold, vm = rows["cold (empty bucket, empty disk)"], rows["recreated VM (empty disk)"]
            print(f"recreated VM / cold: first step {vm['first_call_s'] / cold['first_call_s']:.2f}x, compile+pull "
                  f"{(vm['compile_s'] + vm['load_s'] + vm['pull_s']) / (cold['compile_s'] + cold['load_s']):.2f}x "
                  "(on this CPU plugin torch_xla's tracing, not the compile, dominates a step)")
        finally:
            server.stop()
        sizes(keep)
    return 0


def sizes(keep: Path) -> None:
    """One jax program's entry: the wrapper's, the shared tier's object of it, and JAX's own."""
    from xlakit.cache_tier import objects

    wrapper, own = keep / "jax-wrapper", keep / "jax-own"
    wrapper.mkdir(mode=0o700)
    own.mkdir(mode=0o700)
    os.environ.pop("XLAKIT_CACHE_KEY", None)
    os.environ["XLAKIT_PJRT_CACHE_DIR"] = str(wrapper)
    measure.fresh_process(__file__, ["jax-wrapper"])
    os.environ.pop("XLAKIT_PJRT_CACHE_DIR")
    os.environ["BENCH_JAX_CACHE"] = str(own)
    measure.fresh_process(__file__, ["jax-own-cache"])
    entries = [p for p in wrapper.iterdir() if objects.is_entry_name(p.name)]
    biggest = max(entries, key=lambda p: p.stat().st_size)
    entry = biggest.read_bytes()
    jax_files = sorted((p for p in own.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    jax_size = jax_files[-1].stat().st_size if jax_files else 0
    print(f"entry size of one jax program (bench_compile.py's chain, {os.environ.get('BENCH_LAYERS', '60')} layers) "
          f"on lammps-jax-pjrt-cpu:")
    print(f"  xlakit wrapper entry (local, uncompressed)  {len(entry):>10d} B")
    print(f"  xlakit shared-tier object (compressed)      {len(objects.object_from_entry(entry)):>10d} B")
    print(f"  JAX's own persistent cache entry            {jax_size:>10d} B")


if __name__ == "__main__":
    sys.exit(main())
