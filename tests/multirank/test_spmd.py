"""SPMD-sharded XLA state through xlakit.save: no replication program, exact values.

Each scenario runs in its own process on a 4-device CPU mesh (see spmd_run.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.spmd_run import run_scenario
from xlakit.checkpoint.core import workers
from xlakit.checkpoint.file import spmd

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return run_scenario("save_sharded", tmp_path_factory.mktemp("spmd"))


def test_scenario_shards_what_it_claims(saved):
    assert saved["sharded"] == ["dim1", "even", "padded", "partial_bf16", "pending", "tiled_int"]


def test_saving_sharded_state_compiles_no_replication_program(saved):
    # Regression guard: stock .cpu() of sharded data compiles ReplicateShardedData on every save.
    assert saved["first_save_compiles"] == 1  # the one sync graph of the pending tensor
    assert saved["resave_compiles"] == [0, 0, 0]
    assert saved["small_batch_compiles"] == 0


def test_stock_cpu_of_sharded_tensor_compiles_every_call(saved):
    # The contrast the test above guards against; if upstream fixes it, this fails and says so.
    assert saved["cpu_compiles"] == [1, 1, 1]


def test_sharded_state_round_trips_bit_exactly(saved):
    assert saved["mismatch_xlakit_load"] == []
    assert saved["mismatch_torch_load"] == []


def test_sharded_tensors_travel_in_byte_capped_batches(saved):
    assert saved["small_batch_assembled"] == len(saved["sharded"])
    assert saved["mismatch_small_batch"] == []


def test_shard_copy_runs_under_the_deadline(tmp_path):
    result = run_scenario("sharded_deadline", tmp_path)
    assert result["timeout"]["stage"] == "transfer"
    # The deadline, the owner's wait for the worker (STOP_GRACE_S) and slack for a loaded machine: still under
    # the 3 s the first shard copy takes, so the save did not wait for it.
    assert result["timeout"]["elapsed_s"] < 0.5 + workers.STOP_GRACE_S + 1.5
    assert result["previous_intact"]
    assert result["to_host_expired_stage"] == "transfer"
    assert "cover 24 of its 48 elements" in result["partial_cover_error"]


def test_unsharded_tensors_are_not_sharded():
    import torch_xla

    assert not spmd.is_sharded(torch.ones(3))
    assert not spmd.is_sharded(torch.ones(3, device=torch_xla.device()))


def test_a_device_staged_save_keeps_sharded_copies_split_and_saves_the_values_of_the_call(tmp_path):
    result = run_scenario("device_staged", tmp_path)
    assert result["copies"] == 6 and result["sharded"] == 5  # "replicated" is not split
    assert result["sharded_copies_stay_sharded"] and result["same_specs"]
    assert result["mismatch"] == [] and result["changed_after"]
