"""Clean exits: a script that saved, and then simply ends, ends like Python (no abort, no core).

Each case is a real interpreter run to its natural end, many times over: the
abort this guards against depended on timing (a background thread still
freeing tensors while the interpreter finalized) and hit in most runs, not all.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support import fakes

RUNS = {"async": 20, "manager": 10, "sync": 2, "cancelled": 2, "ctrl-c": 3}  # issue 19: the abort over at least 20 runs
PARALLEL = 4

SCRIPTS = {
    # The issue's own script: an asynchronous save of 20,000 small tensors, waited for, then the end.
    "async": """
        h = xlakit.save({f"p{i}": torch.ones(128) for i in range(20000)}, folder / "c.pt", asynchronous=True)
        h.result()
    """,
    "manager": """
        with xlakit.CheckpointManager(folder / "run", asynchronous=True, max_to_keep=1) as mgr:
            for step in (1, 2):
                mgr.save(step, {f"p{i}": torch.full((128,), float(step)) for i in range(5000)})
    """,
    "sync": """
        xlakit.save({f"p{i}": torch.ones(128) for i in range(5000)}, folder / "c.pt")
    """,
    "cancelled": """
        h = xlakit.save({f"p{i}": torch.ones(128) for i in range(5000)}, folder / "c.pt", asynchronous=True)
        h.cancel()
    """,
    "ctrl-c": """
        h = xlakit.save({f"p{i}": torch.ones(1 << 16) for i in range(1000)}, folder / "c.pt", asynchronous=True)
        print("saving", flush=True)
        h.result()
    """,
}
HEAD = "import pathlib, sys, torch, xlakit\nfolder = pathlib.Path(sys.argv[1])\n"


def _run(case: str, folder) -> tuple[int, str]:
    folder.mkdir()
    code = HEAD + textwrap.dedent(SCRIPTS[case])
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=folder)
    if case == "ctrl-c":
        assert proc.stdout.readline() == "saving\n", proc.communicate()
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    leftovers = [str(p) for p in folder.rglob("*") if p.name.endswith(".xlakit-tmp") or p.name.startswith("core")]
    assert not leftovers, leftovers
    return proc.returncode, err


def _runs(case: str, tmp_path) -> list[tuple[int, str]]:
    with ThreadPoolExecutor(PARALLEL) as pool:
        return list(pool.map(lambda i: _run(case, tmp_path / str(i)), range(RUNS[case])))


def _aborted(err: str) -> bool:
    return any(word in err for word in ("terminate called", "Abort", "abort", "core dumped", "Segmentation"))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["async", "manager"])
def test_a_script_that_ends_after_an_asynchronous_save_exits_0_every_time(tmp_path, case):
    # Regression: SIGABRT ("terminate called without an active exception") at the end of most runs:
    # the exit hook waited for the save, not for its thread, which was still freeing the staged tensors.
    results = _runs(case, tmp_path)
    bad = [(code, err[-500:]) for code, err in results if code != 0 or _aborted(err)]
    assert not bad, f"{len(bad)} of {len(results)} runs did not end cleanly: {bad[:3]}"
    assert all(err == "" for _, err in results), results[0][1]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["sync", "cancelled"])
def test_a_script_that_ends_after_a_save_or_a_cancelled_one_exits_0(tmp_path, case):
    results = _runs(case, tmp_path)
    assert all(code == 0 and err == "" for code, err in results), results


@pytest.mark.slow
def test_ctrl_c_during_an_asynchronous_save_exits_like_python(tmp_path):
    results = _runs("ctrl-c", tmp_path)
    for code, err in results:
        assert code in (-signal.SIGINT, 130) and "KeyboardInterrupt" in err and not _aborted(err), (code, err[-1500:])
    assert not list(tmp_path.glob("*/c.pt"))  # Ctrl-C in result() cancelled it



# A manager's last asynchronous save reaches its commit after its deadline (a fake delay, exactly there), or
# Ctrl-C comes while the manager's exit hook waits for it.
LATE_MANAGER_SAVE = """
    import os, signal, threading, time
""" + fakes.LATE_COMMIT + """
    mgr = xlakit.CheckpointManager(folder / "run", asynchronous=True, options=xlakit.SaveOptions(timeout_s=3))
    mgr.save(1, {"w": torch.ones(4)})
    if sys.argv[2] == "ctrl-c":
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        timer.daemon = True  # Python's exit waits for the other threads before the exit hooks
        timer.start()
"""


@pytest.mark.slow
@pytest.mark.parametrize("how,status", [("deadline", 1), ("ctrl-c", 130)])
def test_a_managers_last_asynchronous_save_lost_at_exit_makes_the_exit_status_nonzero(tmp_path, how, status):
    # Regression (a helper's audit): the manager's own exit hook waited for the save and logged its failure, so
    # the runtime's hook, which sets the status, saw no save it waited for: the script exited 0.
    code = HEAD + textwrap.dedent(LATE_MANAGER_SAVE)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), how], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == status, proc.stderr
    assert "step 1 into" in proc.stderr and "did not commit before the interpreter exited" in proc.stderr
    assert how != "ctrl-c" or "interrupted (Ctrl-C) while waiting for the asynchronous save of step 1" in proc.stderr
    assert not _aborted(proc.stderr)
