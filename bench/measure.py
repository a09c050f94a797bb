"""What every benchmark row measures: wall time, peak RSS increase, compiles; one fresh process per row.

Rows compared with each other (a method and its baseline) are measured in rounds: each round runs
every method once, each in a fresh process, and a row keeps its best wall time over the rounds.
On a machine shared with other work the load changes within seconds; interleaving the methods
exposes each to the same load, so their ratio holds where the absolute times do not.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys
import threading

MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def high_water_mark() -> int:
    """The process's peak RSS so far (VmHWM); `reset_high_water_mark` starts it again from now."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": the high-water mark restarts at the current RSS
        f.write("5")


class PeakRss:
    """Samples this process's RSS every few ms; `peak` is the highest seen."""

    def __init__(self):
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def compiles() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def fresh_process(script: str, args: list[str], timeout_s: float = 1800) -> dict:
    """Run `script --one ...args` in a new interpreter; the JSON row it printed last."""
    out = subprocess.run([sys.executable, script, "--one", *args], capture_output=True, text=True,
                         timeout=timeout_s)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def best_of_rounds(measure, methods: list[str], rounds: int, on_row=None) -> list[dict]:
    """`measure(method)` for every method, `rounds` times interleaved; per method the row with the
    best wall time, all wall times in `walls_s`."""
    best: dict[str, dict] = {}
    walls: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(rounds):
        for m in methods:
            row = measure(m)
            walls[m] += row["walls_s"]
            if m not in best or row["wall_s"] < best[m]["wall_s"]:
                best[m] = row
            if on_row is not None:
                on_row(row)
    return [dict(best[m], walls_s=walls[m], rounds=rounds) for m in methods]


def report(table: str, rows: list[dict], json_path: str | None) -> int:
    """Print a benchmark's table; write its rows as JSON too where asked. The exit status."""
    print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return 0
