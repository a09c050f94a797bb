"""Several ranks, one decision: what every rank agrees on before anything commits or is deleted
(`agreement.py`, its commit gate `agreed_gate.py`, the manager's other decisions `decisions.py`),
and the coordinated layouts on top of one file's pipeline: replicated and sharded (`ranks.py`),
replica-parallel (`replicas.py` with `replica_plan.py`), each with its object-storage sibling
(`bucket_ranks.py`, `bucket_replicas.py`).
"""
