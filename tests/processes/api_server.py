"""A local HTTP server that stands in for a rate-limited API: it logs every call with the key
it carried (as a digest: the log never holds a secret), the fencing number, start and end."""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


@dataclass(frozen=True)
class Call:
    key: str  # sha256 of the bearer token
    fence: int
    start: float
    end: float
    job: int
    granted: float  # when the gate granted the lease (Redis clock; 0: not sent)


@dataclass
class ApiServer:
    rejected: set[str] = field(default_factory=set)  # key digests answered with 401
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> str:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                start = time.time()
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                digest = hashlib.sha256(token.encode()).hexdigest()
                query = parse_qs(urlparse(self.path).query)
                if digest in server.rejected:
                    self.send_response(401)
                    self.end_headers()
                    return
                time.sleep(float(query.get("hold", ["0"])[0]))
                end = time.time()
                with server.lock:
                    server.calls.append(
                        Call(
                            digest,
                            int(query["fence"][0]),
                            start,
                            end,
                            int(query["job"][0]),
                            float(query.get("granted", ["0"])[0]),
                        )
                    )
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/call"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def max_in_window(times: list[float], window: float) -> int:
    """The most calls in any half-open window of ``window`` seconds."""
    times = sorted(times)
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while times[lo] <= t - window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def max_overlap(calls: list[Call]) -> int:
    """The most calls in flight at one instant (sweep line over start/end)."""
    events = sorted(
        [(c.start, 1) for c in calls] + [(c.end, -1) for c in calls], key=lambda e: (e[0], e[1])
    )
    level = best = 0
    for _, step in events:
        level += step
        best = max(best, level)
    return best
