"""Agreement between the ranks of a torch.distributed job, through the job's store alone.

A coordinated save deletes and commits files that other ranks depend on, so
nothing destructive happens until every rank agrees:

1. **Agree on what is saved.** Every rank publishes its proposal (operation
   kind, path, layout, world size, writer, its own deadline) and whether it
   could prepare its part; every rank reads all of them. A rank that differs,
   or failed to prepare, is named on every rank (`CheckpointPeerError`) and
   nothing is touched. A rank that never arrives is named at the deadline.
2. **Vote.** Each rank writes its part, makes it durable and votes ready.
3. **Decide, once.** The commit decision is one store key, claimed with an
   atomic compare-and-set: the committing rank claims "commit" only after
   every rank voted ready, before the earliest deadline of all ranks; a rank
   that gives up for any reason (its deadline, Ctrl-C, an error) claims
   "abort" with its reason. Whichever claim comes first wins everywhere, so a
   late rank 0 can never commit after another rank has given up, and one
   abort means no commit anywhere.

Coordination goes through the store only, never the training collectives or a
process group of xlakit's own that a failed collective could leave broken:
every operation uses fresh keys under `xlakit/op/<n>` (ranks call coordinated
operations in the same order, as they do collectives). Store calls that may
block on an unreachable store host run on the operation's worker thread, whose
owner enforces the deadline; a cancel's claim waits a bounded time. Where DCP
needs a process group for its collectives, `group()` makes a fresh gloo group
for the one operation, after the agreement proved every rank present, with the
remaining deadline as its timeout.

The commit decision itself is `agreed_gate.AgreedGate`, the gate of every
coordinated operation; `decisions.decide` runs any other job-wide decision on
the same terms (a manager's step, the steps its retention deletes). A
`Coordination` with a fixed
`prefix` is a notice board ranks read at their own pace (preemption);
`answering` lets a rank that waits inside an operation answer such a notice.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from xlakit.checkpoint.coordination.agreed_gate import _POLL_S, STORE_HOST, AgreedGate
from xlakit.checkpoint.core.gate import CANCEL, COMMIT
from xlakit.checkpoint.core.operation import Operation
from xlakit.errors import CheckpointPeerError, CheckpointTimeoutError, XlakitError

_SURVIVOR_WAIT_S = 3.0  # after a broken collective, how long survivors wait for each other's reports
_COMMIT_MARGIN_S = 1.0  # the committing rank stops this long before the earliest deadline
_ASIDE_TIMEOUT_S = 2.0  # decision_aside(): a store host that does not answer is the deadline's to judge
_sequence = 0  # coordinated operations started by this process; every rank counts the same
_sequence_lock = threading.Lock()
_answers: list[Callable[[], None]] = []  # run in every wait loop (see `answering`)
# Fields of a proposal every rank must share.
AGREED = ("kind", "path", "layout", "world", "writer_rank", "asynchronous")


@contextlib.contextmanager
def answering(answer: Callable[[], None]):
    """Run `answer()` in every wait of the coordinated operations inside the block.

    For notices other ranks may be blocked on while this rank waits for them (a
    preemption: they wait for this rank's post, this rank waits for them to join).
    """
    _answers.append(answer)
    try:
        yield
    finally:
        _answers.remove(answer)


def _answer() -> None:
    for answer in tuple(_answers):
        answer()


def dist():
    import torch.distributed as d

    if not (d.is_available() and d.is_initialized()):
        raise XlakitError("a coordinated checkpoint (layout='replicated' or 'sharded', or DCP on several "
                          "ranks) needs torch.distributed initialised: call dist.init_process_group() "
                          "first, or use layout='single'")
    return d


def world_size() -> int:
    import torch.distributed as d

    return d.get_world_size() if d.is_available() and d.is_initialized() else 1


def _differing(field: str, values: dict[int, Any]) -> tuple[str, dict[int, Any]]:
    """The innermost settings that differ between the ranks' `values` of `field`, named by their path
    (`config.local.keep`), and each rank's values of those alone."""
    while all(isinstance(v, dict) for v in values.values()):
        keys = sorted({k for v in values.values() for k in v})
        odd = [k for k in keys if len({json.dumps(v.get(k, "<missing>")) for v in values.values()}) > 1]
        if len(odd) != 1:
            if odd:
                field = f"{field} ({', '.join(f'{field}.{k}' for k in odd)})"
                values = {r: {k: v.get(k, "<missing>") for k in odd} for r, v in values.items()}
            break
        field, values = f"{field}.{odd[0]}", {r: v.get(odd[0], "<missing>") for r, v in values.items()}
    return field, values


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


class Coordination:
    """One coordinated operation on this rank: its store keys, its proposal and its decision."""

    def __init__(self, kind: str, proposal: dict[str, Any], *, committer: int = 0,
                 agreed: tuple[str, ...] = (), prefix: str | None = None):
        """`agreed`: proposal fields every rank must share, beyond `AGREED`. `prefix`: a fixed key
        space (a notice board the ranks read at their own pace) instead of the next operation's."""
        global _sequence
        d = dist()
        self.rank, self.world = d.get_rank(), d.get_world_size()
        if prefix is None:
            with _sequence_lock:
                _sequence += 1
                prefix = f"xlakit/op/{_sequence}"
        self.prefix = prefix
        self.agreed = AGREED + tuple(f for f in agreed if f not in AGREED)
        self.store = d.distributed_c10d._get_default_store()
        self.kind = kind
        self.proposal = {"kind": kind, "world": self.world, "layout": None, "writer_rank": None,
                         "asynchronous": False, **proposal}
        self.proposals: dict[int, dict] = {}
        self.waiting_for: list[int] = []  # the ranks this rank is waiting on now, for messages
        self.gate = AgreedGate(self)
        self.op: Operation | None = None
        self.committer = committer
        self.final_sent = False
        self._group = None
        self._aside = None  # decision_aside()'s connection

    # -- store primitives ---------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    @contextlib.contextmanager
    def _reaching_store(self):
        try:
            yield
        except RuntimeError as e:  # DistNetworkError, DistStoreError: the store's host is gone
            err = CheckpointPeerError(
                f"coordinated {self.kind} of {self.proposal['path']} (rank {self.rank} of {self.world}): "
                f"the job's store stopped answering ({_first_line(e)}); rank {STORE_HOST}, which hosts it "
                f"unless the job was started by torchrun, probably died", rank=STORE_HOST)
            if self.gate.outcome is None and self.op is not None and self.op.stage == "commit":
                err.add_note("This rank had voted and did not learn the decision: the checkpoint is "
                             "the new one or the previous one, both whole; this rank's part is kept.")
            raise err from e

    def publish(self, name: str, value: dict) -> None:
        with self._reaching_store():
            self.store.set(self._key(name), json.dumps(value))

    def peek(self, name: str) -> dict | None:
        key = self._key(name)
        with self._reaching_store():
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))

    def decision(self) -> dict | None:
        return self.peek("decision")

    def decision_aside(self) -> dict | None:
        """`decision()` over a connection of its own, answered within `_ASIDE_TIMEOUT_S`: the shared
        one waits behind the worker's blocking calls (the rendezvous of a new group)."""
        if self._aside is None:
            self._aside = self.store.clone()
            self._aside.set_timeout(timedelta(seconds=_ASIDE_TIMEOUT_S))
        key = self._key("decision")
        return json.loads(self._aside.get(key)) if self._aside.check([key]) else None

    def first(self, name: str, value: dict) -> dict:
        """Set `name` to `value` unless a rank set it first; the value that holds (atomic)."""
        mine = json.dumps(value, sort_keys=True)
        with self._reaching_store():
            held = self.store.compare_set(self._key(name), "", mine)
        return json.loads(held)

    def present(self, names: dict[int, str]) -> dict[int, dict]:
        """The records `names[rank]` published so far (one look, no waiting)."""
        found = {}
        for rank, name in names.items():
            value = self.peek(name)
            if value is not None:
                found[rank] = value
        return found

    def claim(self, record: dict) -> dict:
        """Claim the decision with `record`; the decision that holds (ours or the earlier one)."""
        return self.first("decision", record)

    # -- waiting --------------------------------------------------------------------------------
    def wait_for(self, op: Operation, names: dict[int, str], stage: str) -> dict[int, dict]:
        """Every record `names[rank]`, polling until all are there; raises when a rank aborted.

        No timeout here: the operation's owner enforces the deadline (and cancels, which
        this loop notices).
        """
        found: dict[int, dict] = {}
        op.enter(stage)
        while True:
            found.update(self.present({r: n for r, n in names.items() if r not in found}))
            self.waiting_for = sorted(set(names) - set(found))
            if not self.waiting_for:
                return found
            self.raise_if_aborted()
            _answer()
            if self.rank == self.committer and stage == "vote" and self._past_commit_time():
                # Decide before any rank's own deadline, so the verdict names who is missing.
                missing = list(self.waiting_for)
                error = CheckpointTimeoutError(
                    f"coordinated {self.kind} of {self.proposal['path']} (rank {self.rank} of "
                    f"{self.world}): rank(s) {missing} did not vote within the deadline (stalled or "
                    f"died); nothing was committed", stage=stage, rank=missing[0])
                with self.gate.lock:
                    if self.gate.outcome is None:
                        self.gate.settle(self.claim(self._abort_record(
                            f"rank(s) {missing} did not vote within the deadline (stalled or died)",
                            missing, True, stage)))
                if self.gate.outcome == CANCEL and self.gate.held["rank"] == self.rank:
                    raise error
                self.raise_if_aborted()
            op.check()
            time.sleep(_POLL_S)

    def _past_commit_time(self) -> bool:
        return bool(self.proposals) and time.time() >= self.earliest_deadline() - _COMMIT_MARGIN_S

    def raise_if_aborted(self) -> None:
        held = self.decision()
        if held is not None and held["decision"] != COMMIT and held["rank"] != self.rank:
            raise self.peer_error(held)

    def peer_error(self, held: dict) -> Exception:
        """The error this rank raises for a decision another rank made to abort."""
        culprit = held["culprits"][0] if held.get("culprits") else held["rank"]
        consequence = "nothing was committed" if "save" in self.kind else "the load failed"
        message = (f"coordinated {self.kind} of {self.proposal['path']} (rank {self.rank} of {self.world}): "
                   f"{consequence}; rank {held['rank']}: {held['error']}")
        if held.get("timeout"):
            err: Exception = CheckpointTimeoutError(message, stage=held.get("stage") or "coordination",
                                                    rank=culprit)
        else:
            err = CheckpointPeerError(message, rank=culprit)
        if "save" in self.kind:
            err.add_note("No rank commits after one gave up; the last committed checkpoint is untouched.")
        err.decision = held  # the record itself, for callers that word it their own way
        return err

    # -- the phases -----------------------------------------------------------------------------
    def agree(self, op: Operation, prepared: dict | None = None, error: BaseException | None = None) -> None:
        """Publish this rank's proposal; wait for every rank's; raise on any disagreement."""
        self.op = op
        mine = {**self.proposal, "deadline_unix": time.time() + op.remaining(), **(prepared or {})}
        if error is not None:
            mine["error"] = _first_line(error)
        self.publish(f"proposal/{self.rank}", mine)
        if error is not None:
            raise error
        self.proposals = self.wait_for(op, {r: f"proposal/{r}" for r in range(self.world)}, "agree")
        failed = {r: p["error"] for r, p in self.proposals.items() if "error" in p}
        if failed:
            lines = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
            raise CheckpointPeerError(f"coordinated {self.kind} of {self.proposal['path']} (rank "
                                      f"{self.rank} of {self.world}): other ranks could not start, "
                                      f"nothing was touched: {lines}", rank=min(failed))
        for field in self.agreed:
            values = {r: p.get(field) for r, p in self.proposals.items()}
            if len(set(map(json.dumps, values.values()))) > 1:
                raise self._mismatch(field, values)

    def _mismatch(self, field: str, values: dict[int, Any]) -> CheckpointPeerError:
        field, values = _differing(field, values)
        common, _ = Counter(json.dumps(v) for v in values.values()).most_common(1)[0]
        odd = [r for r, v in values.items() if json.dumps(v) != common] or sorted(values)[1:]
        shown = ", ".join(f"rank {r}: {v!r}" for r, v in sorted(values.items()))
        err = CheckpointPeerError(
            f"coordinated {self.kind} (rank {self.rank} of {self.world}): the ranks disagree on "
            f"{field} ({shown}); nothing was written, deleted or committed", rank=odd[-1])
        err.add_note("Every rank must call the same coordinated operation, with the same path and "
                     "options, in the same order.")
        return err

    def vote(self, value: dict, round_: str = "vote") -> None:
        self.publish(f"{round_}/{self.rank}", {"ok": True, **value})

    def votes(self, op: Operation, round_: str = "vote") -> dict[int, dict]:
        """Every rank's vote of `round_` (raises as soon as any rank aborted)."""
        return self.wait_for(op, {r: f"{round_}/{r}" for r in range(self.world)}, round_)

    def earliest_deadline(self) -> float:
        return min(p["deadline_unix"] for p in self.proposals.values())

    def abort(self, error: BaseException, *, stage: str, waiting: bool = False) -> None:
        """Record that this rank gives up because of `error`.

        This rank is the culprit, unless `waiting`: the error came from a collective
        that a peer broke (it died or stalled). Then every surviving rank reports
        itself, and the ranks that never report are named instead.
        """
        if self.gate.outcome is not None:
            return
        # An error that already names its culprit (a disagreement found in `agree`) keeps it.
        named = getattr(error, "rank", None)
        culprits = [self.rank if named is None else named]
        if waiting:
            try:
                self.publish(f"broken/{self.rank}", {"error": _first_line(error)})
            except CheckpointPeerError:
                return
            end = time.monotonic() + min(_SURVIVOR_WAIT_S, self.op.remaining() if self.op else 0.0)
            missing = [r for r in range(self.world) if r != self.rank]
            while missing and time.monotonic() < end and self.decision() is None:
                missing = [r for r in missing if not self.store.check([self._key(f"broken/{r}")])]
                time.sleep(_POLL_S)
            culprits = missing or [self.rank]
        stalled = waiting and culprits != [self.rank]
        message = _first_line(error)
        if stalled:
            message = f"rank(s) {culprits} stopped answering (died or stalled); here: {message}"
        with self.gate.lock:
            if self.gate.outcome is None:
                try:
                    held = self.claim(self._abort_record(
                        message, culprits, isinstance(error, TimeoutError) or stalled, stage))
                except CheckpointPeerError:
                    return  # the store is gone: the outcome stays unknown here, nothing is discarded
                self.gate.settle(held)

    def _abort_record(self, error: str, culprits: list[int], timeout: bool, stage: str) -> dict:
        # `unix`: when this rank gave up. Its claim may reach a stalled store host only after that host
        # resumed, so a late rank reads from it, not from the claim's arrival, that it came too late.
        return {"decision": "abort", "rank": self.rank, "culprits": culprits, "timeout": timeout,
                "stage": stage, "error": error, "unix": time.time()}

    @contextlib.contextmanager
    def giving_up(self, op: Operation, *, waiting: Callable[[BaseException], bool] = lambda e: False):
        """Any failure inside is this rank giving up: claimed in the store, so no rank commits.

        `waiting(e)` says whether `e` came from waiting on a peer (a broken collective).
        """
        try:
            yield
        except BaseException as e:
            if self.gate.outcome == COMMIT and self.rank == self.committer and not self.final_sent:
                # Decided, then failed to write the commit: the others must not wait for it.
                self.finish({"ok": False, "error": _first_line(e)})
            waited = waiting(e)
            self.abort(e, stage=op.stage, waiting=waited)
            held = self.gate.held
            if waited and held and held.get("decision") != COMMIT and self.rank not in held["culprits"]:
                raise self.peer_error(held) from e  # the decided culprit, not this rank's symptom
            raise

    def finish(self, final: dict) -> None:
        """(The committing rank.) Tell every rank how the commit ended."""
        self.publish("final", final)
        self.final_sent = True

    def outcome(self, op: Operation) -> dict:
        """(Not the committing rank.) Wait for the decision and the committer's final word."""
        committer = self.committer
        self.waiting_for = [committer]
        op.enter("commit")
        while True:
            held = self.decision()
            if held is not None and held["decision"] == COMMIT:
                self.gate.settle(held)
                final = self.peek("final")
                if final is not None:
                    return final
            elif held is not None and held["rank"] != self.rank:  # its own abort: `op.check()` stops this worker
                raise self.peer_error(held)
            _answer()
            op.check()
            time.sleep(_POLL_S)

    def all_or_none(self, op: Operation, part: Callable[[], Any]) -> Any:
        """This rank's `part()` of an agreed read; every rank returns, or every rank raises (a
        failure here is claimed as this rank's abort, which the others then raise)."""
        try:
            result = part()
        except BaseException as e:
            self.abort(e, stage=op.stage)
            raise
        self.vote({})
        self.votes(op)
        return result

    def expect_commit(self, op: Operation, what: str) -> None:
        """(Not the committing rank.) Wait for the commit of `what`; raise, naming the committing
        rank, when it could not commit."""
        final = self.outcome(op)
        if not final.get("ok"):
            raise CheckpointPeerError(f"rank {self.committer} could not commit {what}: {final.get('error')}",
                                      rank=self.committer)

    def group(self, op: Operation):
        """A fresh gloo group for this operation (every rank agreed, so every rank calls this)."""
        if self._group is None:
            d = dist()
            op.enter("group")
            self._group = d.new_group(backend="gloo", timeout=timedelta(seconds=max(op.remaining(), 0.1)))
        return self._group

    def close(self) -> None:
        if self._group is not None:
            try:
                dist().destroy_process_group(self._group)
            except Exception:  # noqa: BLE001 - a broken group is dropped all the same
                pass
            self._group = None


