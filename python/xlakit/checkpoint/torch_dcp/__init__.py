"""Sharded state through torch.distributed.checkpoint (DCP), committed atomically: one process
(`dcp.py`, its planner `dcp_plan.py`), every rank of a job around one agreed commit (`dcp_ranks.py`),
and the same on object storage (`bucket_dcp.py`).
"""
