"""Several ranks, one decision: what every rank agrees on before anything commits or is deleted
(`agreement.py`), its commit gate that any rank's abort pre-empts (`agreed_gate.py`), and the
manager's other agreed decisions (`decisions.py`).

The protocol only: the layouts that use it (`multirank/`, `torch_dcp/`) and the manager sit above.
"""
