"""Start the ranks of a real multi-process job for a test: gloo over loopback.

`run` starts a job and waits for it; `Job` keeps the processes in hand so a
test can inject faults by PID (SIGKILL, SIGSTOP/SIGCONT, SIGINT) at moments
the ranks announce on stdout as JSON lines (`{"event": ...}`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def let_children_take_ctrl_c() -> None:
    """Make the processes a test starts react to SIGINT, as a user's terminal would.

    A command started in the background by a non-interactive shell (`cmd &`, some CI
    runners) inherits SIGINT *ignored*, and an ignored signal stays ignored across exec:
    Python then never installs its KeyboardInterrupt handler, and a test that presses
    Ctrl-C in a child would see nothing happen. A handler (unlike SIG_IGN) is reset to the
    default at exec, so installing Python's own here gives every child the normal behaviour.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _ephemeral_ports() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


_ports = iter(())


def private_port() -> int:
    """A port for a job's rank 0 to host the rendezvous store on (or a test server), one no other
    test picks.

    Chosen below the kernel's ephemeral range, so that no socket bound to port 0 (an
    emulator, a gloo pair, an outgoing connection) can take it between this choice and
    rank 0's bind: a port the kernel handed out free here and rank 0 bound later was
    once taken meanwhile (a CI run: rank 1 died in TCPStore's constructor before its
    first line). Each xdist worker draws from its own block, each port at most once.
    """
    global _ports
    for port in _ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    ephemeral = _ephemeral_ports()
    top = ephemeral.start if ephemeral.start > 20000 else 65536
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
    block = 1500
    first = top - block * (worker % 8 + 1)
    if first <= 1024 or ephemeral.start < first + block <= ephemeral.stop:
        raise RuntimeError(f"no ports outside the ephemeral range {ephemeral.start}-{ephemeral.stop - 1} "
                           f"for test jobs; widen net.ipv4.ip_local_port_range's gap")
    offset = (os.getpid() * 7) % block  # a fresh process resumes elsewhere in its block
    _ports = iter([first + (offset + i) % block for i in range(block)])
    return private_port()


def stderr_excerpt(text: str, keep: int = 1500) -> str:
    """A rank's stderr shortened for an assertion: its start (where the error is named) and its end."""
    return text if len(text) <= 2 * keep else f"{text[:keep]}\n[...]\n{text[-keep:]}"


class Job:
    """Ranks 0..world-1 of `worker scenario folder`, their stdout read as JSON lines."""

    def __init__(self, worker: Path, scenario: str, folder: Path, world: int, env: dict | None = None):
        base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(private_port()),
                "WORLD_SIZE": str(world), **(env or {})}
        self.procs = [subprocess.Popen([sys.executable, str(worker), scenario, str(folder)],
                                       env={**base, "RANK": str(r)}, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True) for r in range(world)]
        self.lines: list[list[dict]] = [[] for _ in range(world)]
        self.errors = ["" for _ in range(world)]
        self._changed = threading.Condition()
        self._readers = []
        for r, p in enumerate(self.procs):
            for stream, sink in ((p.stdout, self._line_sink(r)), (p.stderr, self._err_sink(r))):
                t = threading.Thread(target=self._read, args=(stream, sink), daemon=True)
                t.start()
                self._readers.append(t)

    def _line_sink(self, rank: int):
        def sink(line: str) -> None:
            if line.startswith("{"):
                with self._changed:
                    self.lines[rank].append(json.loads(line))
                    self._changed.notify_all()
        return sink

    def _err_sink(self, rank: int):
        def sink(line: str) -> None:
            self.errors[rank] += line
        return sink

    @staticmethod
    def _read(stream, sink) -> None:
        for line in stream:
            sink(line)

    def pid(self, rank: int) -> int:
        return self.procs[rank].pid

    def wait_event(self, rank: int, event: str, timeout: float = 60.0, **fields) -> dict:
        """The first line `{"event": event, **fields}` rank `rank` printed, waiting for it."""
        end = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines[rank]:
                    if line.get("event") == event and all(line.get(k) == v for k, v in fields.items()):
                        return line
                left = end - time.monotonic()
                if left <= 0 or self.procs[rank].poll() is not None and not self._pending(rank, event):
                    raise AssertionError(f"rank {rank} never printed event {event!r}: "
                                         f"{self.lines[rank]} {stderr_excerpt(self.errors[rank])}")
                self._changed.wait(min(left, 0.1))

    def _pending(self, rank: int, event: str) -> bool:
        return any(line.get("event") == event for line in self.lines[rank])

    def wait_stopped(self, rank: int, timeout: float = 60.0) -> None:
        """Until rank `rank` is stopped (it sent itself SIGSTOP)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with open(f"/proc/{self.pid(rank)}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return
            time.sleep(0.02)
        raise AssertionError(f"rank {rank} did not stop")

    def signal(self, rank: int, sig: int) -> None:
        os.kill(self.pid(rank), sig)

    def results(self, timeout: float = 120.0) -> dict[int, dict]:
        """Wait for every rank; each one's last `{"result": ...}` line, or its exit status and stderr."""
        end = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    if q.poll() is None:
                        q.send_signal(signal.SIGCONT)
                        q.kill()
                raise AssertionError(f"the job hung: {[q.returncode for q in self.procs]}, "
                                     f"{[stderr_excerpt(e, 750) for e in self.errors]}") from None
        for t in self._readers:
            t.join(5)
        for p in self.procs:
            p.stdout.close()
            p.stderr.close()
        out = {}
        for r, p in enumerate(self.procs):
            found = [line["result"] for line in self.lines[r] if "result" in line]
            out[r] = found[-1] if found else {}
            out[r]["exit"] = p.returncode
            out[r]["stderr"] = stderr_excerpt(self.errors[r])
        return out


def run(worker: Path, scenario: str, folder: Path, world: int) -> list[tuple[int, str, str]]:
    """Run `worker scenario folder` as ranks 0..world-1; (exit status, JSON lines, stderr) each."""
    job = Job(worker, scenario, folder, world)
    results = job.results()
    return [(results[r]["exit"], "\n".join(json.dumps(line) for line in job.lines[r]), job.errors[r])
            for r in range(world)]


def leave_together(rank: int, world: int, *, dead: set[int] = frozenset(), wait_s: float = 15.0) -> None:
    """End a worker rank of a test job, never returning. Rank 0 hosts the job's store, so it stays until
    every rank not in `dead` said it is done (or `wait_s` passed: a peer stuck on purpose is named by the
    test from its missing JSON line); then the process exits without the process group's teardown, which a
    dead or stuck peer would hang."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.set(f"exit/{rank}", "1")
    if rank == 0:
        try:
            store.wait([f"exit/{r}" for r in range(world) if r not in dead], timedelta(seconds=wait_s))
        except RuntimeError:
            pass
    os._exit(0)
