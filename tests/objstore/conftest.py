"""Fixtures of the object-storage tests (the servers and the bucket fixture are in tests/conftest.py)."""

import pytest


@pytest.fixture
def one_rank():
    """torch.distributed with one rank (gloo on loopback): a sharded save of one shard, in this process."""
    import torch.distributed as dist

    from tests.support.objstore_servers import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
