"""xlakit's coordinated layouts, one file's pipeline on every rank under one agreement
(`coordination/`): replicated and sharded (`ranks.py`), replica-parallel (`replicas.py` with
`replica_plan.py`), each with its object-storage sibling (`bucket_ranks.py`, `bucket_replicas.py`).
"""
