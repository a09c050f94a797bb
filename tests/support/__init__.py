"""What the tests share: the processes they start (the `*_worker.py` scripts, `spmd_run.py`,
`pjrt_job.py`), the object-storage test servers and the fake network in front of them, the
named fakes, and the fault-injection run behind `make faults`."""

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
REPO = SUPPORT.parents[1]
