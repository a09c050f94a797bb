"""A fake network between a client and a real local object-storage server: transient failures on cue.

The servers of `objstore_servers.py` never fail a request on their own, so the
retry paths of the clients and of xlakit would go untested. `FlakyProxy` is an
HTTP proxy on 127.0.0.1 in front of one of them: the client is pointed at the
proxy by the same standard variable (`env()`), and every request is forwarded
to the real server unchanged, except those a rule picks, which

* `FAIL`: are answered 503 without reaching the server (a transient outage),
* `THROTTLE`: are answered 429 Too Many Requests without reaching the server
  (a bucket's request rate exceeded, as GCS answers busy JAX jobs), or
* `LOSE`: reach the server and are carried out, but their answer is replaced by
  a 503 (the answer lost on the way back: the client cannot know the write
  happened).

A rule is a predicate on (method, path with query, headers) and a count of
requests it still applies to. Every request is logged, with what was done to
it, so a test can assert the faults were injected. This is the one fake in
the object-storage tests, and it fakes the network only: the client library
and the server are real.
"""

from __future__ import annotations

import http.client
import http.server
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

FAIL, LOSE, PASS, THROTTLE = "fail", "lose", "pass", "throttle"
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection",
        "content-length"}
Match = Callable[[str, str, dict], bool]


@dataclass
class Rule:
    match: Match
    action: str
    times: int


@dataclass
class Seen:
    method: str
    path: str
    action: str
    status: int
    nbytes: int = 0  # the request's body


@dataclass
class FlakyProxy:
    """`FlakyProxy(server)` forwards to `server.url`; `add(match, action, times)` arms a fault."""

    server: object
    rules: list[Rule] = field(default_factory=list)
    log: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        target = self.server.url.removeprefix("http://")
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in _HOP:
                        self.send_header(k, v.replace(proxy.server.url, proxy.url))
                length = dict((k.lower(), v) for k, v in headers).get("content-length", "0")
                self.send_header("Content-Length", length if self.command == "HEAD" else str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _handle(self) -> None:
                body = self._body()
                action = proxy._decide(self.command, self.path, dict(self.headers))
                if action == FAIL:
                    proxy._seen(self.command, self.path, action, 503, len(body))
                    return self._answer(503, [("Content-Type", "text/plain")], b"injected: service unavailable")
                if action == THROTTLE:
                    proxy._seen(self.command, self.path, action, 429, len(body))
                    return self._answer(429, [("Content-Type", "text/plain")], b"injected: rate limit exceeded")
                conn = http.client.HTTPConnection(target, timeout=120)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    headers["Host"] = target
                    conn.request(self.command, self.path, body=body, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                finally:
                    conn.close()
                if action == LOSE:
                    proxy._seen(self.command, self.path, action, 503, len(body))
                    return self._answer(503, [("Content-Type", "text/plain")], b"injected: answer lost")
                proxy._seen(self.command, self.path, action, reply.status, len(body))
                self._answer(reply.status, reply.getheaders(), data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _handle

        class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:
                pass  # a client that gave up (its deadline) closed the connection: nothing to report

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def env(self) -> dict[str, str]:
        """The server's client variables, pointing at this proxy instead."""
        return {k: v.replace(self.server.url, self.url) for k, v in self.server.env().items()}

    def add(self, match: Match, action: str, times: int = 1) -> None:
        with self.lock:
            self.rules.append(Rule(match, action, times))

    def _decide(self, method: str, path: str, headers: dict) -> str:
        with self.lock:
            for rule in self.rules:
                if rule.times > 0 and rule.match(method, path, headers):
                    rule.times -= 1
                    return rule.action
        return PASS

    def _seen(self, method: str, path: str, action: str, status: int, nbytes: int) -> None:
        with self.lock:
            self.log.append(Seen(method, path, action, status, nbytes))

    def injected(self) -> list[Seen]:
        with self.lock:
            return [s for s in self.log if s.action != PASS]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
