"""The review's programs whose cache keys collided, through the wrapper on real plugins (issue 32 item 4).

tests/runtime/programs/review_*: `review_A.mlir` and `review_B.mlir` are one jax 0.10 portable artifact in
which A calls `sin` and B `cos`, each with a vhlo string whose index is spelled with two bytes and is also a
location's file name; the key searched only for the shortest spelling, so both got one key, and B returned
A's numbers. `review_hloA.pb` and `review_hloB.pb` hold one frontend attribute key twice (once behind a
two-byte tag) in opposite orders: protobuf reads k=Y and k=X; the key sorted them into one. A program shim
in front of the wrapper (tests/support/pjrt_shims.py) hands the wrapper these bytes in place of what jax
compiles, or appends the attributes to each of torch_xla's real programs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, key_canon, pjrt_job, pjrt_shims
from xlakit.runtime import pjrt_wrap

PROGRAMS = Path(__file__).parent / "programs"
PYTHONPATH = os.pathsep.join([str(Path(pjrt_wrap.__file__).resolve().parents[2]), str(REPO)])
X = [0.1, 0.2, 0.3, 0.4]
KEY = "k" * 32  # an authenticated cache, as the review ran it

pytestmark = [pytest.mark.pjrt, pytest.mark.slow]

_JAX = """
import json, os
import numpy as np
from tests.support import pjrt_job
from xlakit.runtime import pjrt_wrap
jax = pjrt_job.start_jax(os.environ["SHIM"])

def f(x):  # lowered as module @jit_f: the shim hands the wrapper SHIM_REPLACE instead
    return x + 1.0

y = jax.jit(f)(np.array({x}, np.float32))
print(json.dumps({{"result": np.asarray(y).tolist(), "status": pjrt_wrap.status()}}))
"""


def _run(args: list[str], **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("XLAKIT_", "XLA_", "TPU_", "SHIM_"))}
    base.update(PYTHONPATH=PYTHONPATH, **env)
    done = subprocess.run([sys.executable, *args], env=base, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_reviews_mlir_pair_gets_two_keys_and_b_returns_its_own_numbers(tmp_path):
    # Regression (issue 32): the key searched file-name indices in one spelling only; B hit A's entry.
    env = dict(SHIM=str(pjrt_shims.program_shim(tmp_path)), SHIM_NEXT=str(pjrt_wrap.library_path()),
               SHIM_MATCH="jit_f", XLAKIT_PJRT_PLUGIN=pjrt_job.lammps_plugin(),
               XLAKIT_PJRT_CACHE_DIR=str(tmp_path / "cache"), XLAKIT_CACHE_KEY=KEY)
    script = ["-c", _JAX.format(x=X)]
    a = _run(script, SHIM_REPLACE=str(PROGRAMS / "review_A.mlir"), **env)
    assert a["status"]["counts"]["writes"] == 1 and a["status"]["cache"]["authenticated"]
    b = _run(script, SHIM_REPLACE=str(PROGRAMS / "review_B.mlir"), **env)
    assert b["status"]["counts"]["hits"] == 0 and b["status"]["counts"]["writes"] == 1
    assert a["result"] == pytest.approx([10 * math.sin(x) + math.cos(x) for x in X], rel=1e-5)
    assert b["result"] == pytest.approx([11 * math.cos(x) for x in X], rel=1e-5)
    again = _run(script, SHIM_REPLACE=str(PROGRAMS / "review_B.mlir"), **env)  # B's own entry
    assert again["status"]["counts"]["hits"] == 1 and again["result"] == b["result"]


def test_the_reviews_hlo_protos_get_two_keys():
    # Regression (issue 32): map entries were sorted by the key as written, first field 1 taken.
    a, b = ((PROGRAMS / f"review_hlo{n}.pb").read_bytes() for n in "AB")
    assert key_canon.canonical_program("hlo", a) != key_canon.canonical_program("hlo", b)


def test_frontend_attributes_that_protobuf_reads_differently_miss_on_torch_xla(tmp_path):
    # Regression (issue 32): the review's attributes, appended to each of torch_xla's real programs.
    shim = pjrt_shims.program_shim(tmp_path)
    for n in "AB":  # the module's frontend_attributes field alone, without the module name before it
        (tmp_path / n).write_bytes((PROGRAMS / f"review_hlo{n}.pb").read_bytes()[3:])
    env = dict(XLAKIT_TEST_REAL_PLUGIN=str(shim), SHIM_NEXT=str(pjrt_wrap.library_path()),
               XLAKIT_PJRT_PLUGIN=pjrt_job.xla_cpu_plugin(), XLAKIT_PJRT_CACHE_DIR=str(tmp_path / "cache"))
    job = [str(Path(pjrt_job.__file__)), "torch_xla"]
    a = _run(job, SHIM_APPEND=str(tmp_path / "A"), **env)["status"]["counts"]
    assert a["writes"] == a["compiles"] > 0
    b = _run(job, SHIM_APPEND=str(tmp_path / "B"), **env)["status"]["counts"]
    assert b["hits"] == 0 and b["misses"] == b["compiles"] > 0
    again = _run(job, SHIM_APPEND=str(tmp_path / "A"), **env)["status"]["counts"]
    assert again["hits"] == again["compiles"] > 0  # the same attributes: the same keys
