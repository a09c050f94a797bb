"""One manager per manager URL on object storage: a lease made of create-only objects.

On a local disk a manager holds an flock that the kernel drops when its
process dies. A bucket has no locks and no process to watch, so the holder
of a manager URL `M` is named by the newest lease object
`M/xlakit-lease.<n>.json` ({holder, host, pid, id, expires_unix}):

* **Acquire**: read the newest lease. None, or one that expired (its holder
  stopped renewing it), or one whose holder is a dead process of this host:
  create lease n+1, create-only, so of two managers taking over at once
  exactly one wins. A lease held by a live process of this host is refused
  at once with `CheckpointBusyError` naming the holder; one held from
  another host (whose process cannot be checked from here) is waited for
  while its expiry is within the caller's deadline (a job restarted on other
  hosts takes over from the one it replaces), else refused the same way.
* **Renew**: the holder checks that its lease n is still the newest (a
  taker deletes the older ones), creates lease n+1 (create-only) with a new
  expiry and deletes lease n: before a save, to cover the save's deadline; before a
  retention, and whenever `should_save` finds it half spent or still
  stretched by a save, to its own duration. If lease n is gone or not the
  newest, or n+1 is taken, another manager took the URL over after this
  one's lease expired: the save or retention does not start
  (`CheckpointBusyError`).
* **Release**: the holder deletes its lease objects (and the older ones its
  lease superseded), never a newer one.

The expiry is the holder's clock; a taker allows `SKEW_S` more for clocks that
differ between hosts. A holder silent for longer than its lease (a process
stopped for minutes between two steps) can be taken over: it finds out at
its next renewal and stops before it writes or deletes anything.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from typing import TYPE_CHECKING

from xlakit import _knobs
from xlakit.checkpoint.core import paths
from xlakit.checkpoint.objstore.client import Location, Store
from xlakit.errors import CheckpointBusyError

if TYPE_CHECKING:
    from xlakit.checkpoint.core.operation import Operation

PREFIX = "xlakit-lease."
_NAME = re.compile(r"xlakit-lease\.(\d{20})\.json")
SKEW_S = 30.0  # how far the clocks of two hosts may differ
_POLL_S = 2.0


def lease_name(n: int) -> str:
    return f"{PREFIX}{n:020d}.json"


def is_lease(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


class Lease:
    """This manager's hold on the manager URL `loc`."""

    def __init__(self, store: Store, loc: Location):
        self.store, self.loc = store, loc
        self.duration_s = _knobs.get_float(_knobs.MANAGER_LEASE_S)
        self.id = secrets.token_hex(8)
        self.number: int | None = None  # the lease object this manager holds
        self.expires_unix = 0.0

    def _leases(self, op: "Operation | None") -> dict[int, str]:
        found = self.store.list(op, self.loc, starting=PREFIX)
        return {int(m.group(1)): name for name in found if (m := _NAME.fullmatch(name))}

    def _read(self, op: "Operation | None", n: int) -> dict:
        try:
            body = json.loads(self.store.get(op, self.loc.child(lease_name(n))))
            return body if isinstance(body, dict) else {}
        except FileNotFoundError:
            return {"released": True}  # released while we looked
        except ValueError:
            return {}  # unreadable: held until it expires (it names no expiry: never), see below

    def _free(self, body: dict) -> bool:
        if body.get("released") or body.get("id") == self.id:
            return True
        expires = body.get("expires_unix")
        if isinstance(expires, (int, float)) and time.time() > expires + SKEW_S:
            return True
        return body.get("host") == paths.host() and isinstance(body.get("pid"), int) and \
            body["pid"] != os.getpid() and not paths.pid_alive(body["pid"])

    def _create(self, op: "Operation | None", n: int, cover_s: float) -> bool:
        expires = time.time() + max(self.duration_s, cover_s)
        body = {"holder": f"pid {os.getpid()} on {paths.host()}", "host": paths.host(), "pid": os.getpid(),
                "id": self.id, "time_unix": time.time(), "expires_unix": expires}
        try:
            self.store.put(op, self.loc.child(lease_name(n)), json.dumps(body, indent=1).encode(), create_only=True)
        except FileExistsError:
            return False
        self.number, self.expires_unix = n, expires
        return True

    def _drop_below(self, op: "Operation | None", n: int, leases: dict[int, str]) -> None:
        self.store.delete(op, [self.loc.child(name) for m, name in leases.items() if m < n])

    def acquire(self, op: "Operation", cover_s: float = 0.0) -> None:
        """Hold the URL, waiting for a held lease to expire while `op`'s deadline allows.

        Raises:
            CheckpointBusyError: another manager holds it (named) beyond the deadline.
        """
        while True:
            leases = self._leases(op)
            newest = max(leases, default=0)
            body = self._read(op, newest) if newest else {"released": True}
            if self._free(body) and self._create(op, newest + 1, cover_s):
                self._drop_below(op, newest + 1, leases)
                return
            if not self._free(body):
                expires = body.get("expires_unix")
                wait = (expires + SKEW_S - time.time()) if isinstance(expires, (int, float)) else float("inf")
                if body.get("host") == paths.host() or wait > op.remaining():
                    raise self._busy(body, newest)  # alive here, or not expiring in time
            end = time.monotonic() + _POLL_S
            while time.monotonic() < end:
                op.check()
                time.sleep(0.1)

    def _busy(self, body: dict, n: int) -> CheckpointBusyError:
        holder = body.get("holder") or "a holder that did not say who"
        expires = body.get("expires_unix")
        left = (f"its lease expires in {expires - time.time():.0f} s unless renewed"
                if isinstance(expires, (int, float)) else "its lease names no expiry")
        err = CheckpointBusyError(f"another checkpoint manager is using {self.loc} ({holder}; {left}); two "
                                  f"managers on one URL would delete each other's saves in progress")
        err.add_note(f"Close the other manager, stop the other job, or give this run a URL of its own. If that "
                     f"job is gone for good, delete {self.loc.child(lease_name(n))} (or wait for its lease to "
                     f"expire: a manager renews it while it runs, {self.duration_s:g} s at a time, "
                     f"XLAKIT_MANAGER_LEASE_S).")
        return err

    def renew(self, op: "Operation | None", cover_s: float = 0.0) -> None:
        """Let the lease end max(its duration, `cover_s`) from now (`cover_s`: a save's deadline),
        unless it ends about then already: renewed once half spent, and shortened again after a
        long save (so a job restarted elsewhere does not wait for a save's deadline).

        Raises:
            CheckpointBusyError: another manager took the URL over after this lease expired.
        """
        want, left = max(self.duration_s, cover_s), self.expires_unix - time.time()
        if self.number is None or want / 2 < left <= want + self.duration_s / 2:
            return
        old = self.number
        leases = self._leases(op)
        # Still the newest lease object, or another manager took over (and dropped this one's).
        if max(leases, default=None) != old or not self._create(op, old + 1, cover_s):
            self.number = None
            err = CheckpointBusyError(f"the checkpoint manager of {self.loc} lost its lease: another manager "
                                      f"took the URL over after it expired; this manager stops before writing "
                                      f"or deleting anything")
            err.add_note("This process did not call the manager for longer than its lease (XLAKIT_MANAGER_LEASE_S); "
                         "raise it, or make sure one job at a time uses the URL.")
            raise err
        self.store.delete(op, [self.loc.child(lease_name(old))])

    def release(self) -> None:
        """Give the URL up: this manager's lease objects and the older ones go, never a newer one."""
        if self.number is None:
            return
        n, self.number = self.number, None
        leases = self._leases(None)
        self._drop_below(None, n + 1, leases)
