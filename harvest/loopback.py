"""A local HTTP service that behaves like a rate-limited AI API, for the demo, tests and bench.

Each key (a Bearer token) may have at most ``concurrency`` calls in flight and ``rate`` calls
admitted in any sliding window of ``period`` seconds (60: "R per minute"). A call beyond either
is answered ``429`` at once (a key may enforce lower limits than it declares, ``true_concurrency``
and ``true_rate``: a service whose real limits are below what its users were told), with
``Retry-After`` set to the true remaining wait (seconds, to the
millisecond; ``Retry-After-Ms`` too) and is not counted against the key. An unknown key gets
``401``. An admitted call takes a lognormal time with median ``latency`` and shape ``sigma``
(default 0.3: mean = median x exp(sigma^2 / 2) = 1.046 x median; 5 % of calls take more than
1.64 x the median), then is answered ``500`` with probability ``error_rate``, else ``200`` with
``{"job", "attempt", "usage": {"total_tokens": n}}``.

Tokens: each call uses ``n`` tokens, from the request's ``"tokens"``, else drawn uniformly from
``tokens_range`` (seeded), else ``tokens``. A key may have a token budget, ``tpm`` tokens admitted
in any sliding window of ``token_period`` seconds (60): a call whose tokens do not fit is answered
``429`` (``http_429_tokens``), not counted. The tokens are counted at admission, as AI APIs count
a request's tokens when it arrives. Every answer to a known key carries the rate-limit headers of
the AI APIs: ``x-ratelimit-limit-requests``, ``x-ratelimit-remaining-requests``,
``x-ratelimit-reset-requests``, and the same three for ``-tokens`` (resets as ``1.5s``). The
service keeps the peak of tokens in a key's window (admitted: never above ``tpm``; and as asked,
with the arriving call counted, refused or not: the oracle of a client that overruns a budget);
:func:`window_peaks` works out the same from the log, per key.

A call names its job and attempt in its JSON body (``{"job": 17, "attempt": 1}``) or in the
``X-Job-Id`` / ``X-Attempt`` headers; ``"latency": s`` in the body overrides the drawn latency.
With a ``seed``, a call that names its item of work (``"i": n`` in the body, an integer) takes
that item's latency, drawn from the seed and ``n`` alone: clients that send the same items get
the same latencies, whatever order their calls come in (the goodput benchmark compares its
subjects on the same work, not on two samples of it).
The service records per key: requests, 200s, 429s (by cause), 500s, the peak of calls in flight
it admitted (never above ``concurrency``) and the peak it was asked to hold (admitted in flight
plus the arriving call, refused or not: the oracle of a client that overruns a key), and a log
of every call: (key name, job, attempt, start, end, status, tokens), wall-clock seconds.
Secrets are never logged or returned: calls are told apart by key name.

    GET /_stats              per-key counters and peaks
    GET /_log?since=N        the call log from entry N: {"fields", "rows", "next"}
    POST /_reset             counters, peaks and log emptied (in-flight calls and windows kept)

Raw asyncio streams, HTTP/1.1 keep-alive, no framework: it serves about a thousand open
connections and hundreds of calls a second from one process. Run it in its own process:
``python -m harvest.loopback --keys keys.json --port 0`` (prints its URL on the first line;
``--keys -`` reads the JSON from stdin), or :func:`start_loopback` from Python.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

from harvest.loopback_limits import SIGMA, KeyState, LoopKey, mean_latency, window_peaks

__all__ = [
    "SIGMA",
    "KeyState",
    "LoopKey",
    "Loopback",
    "LoopbackHandle",
    "load_keys",
    "mean_latency",
    "start_loopback",
    "window_peaks",
]

LOG_FIELDS = ("key", "job", "attempt", "start", "end", "status", "tokens")
MAX_BODY = 1 << 20
MAX_LOG = 5_000_000  # calls logged at most (then counted in log_dropped): about 1 GiB
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           429: "Too Many Requests", 500: "Internal Server Error"}  # fmt: skip


# --- the service ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class Loopback:
    """The service's state and its answers; :meth:`serve` puts it on a socket."""

    def __init__(
        self,
        keys: Sequence[LoopKey],
        *,
        latency: float,
        sigma: float = SIGMA,
        error_rate: float = 0.0,
        tokens: int = 100,
        tokens_range: tuple[int, int] | None = None,
        seed: int | None = None,
    ) -> None:
        if tokens_range is not None and not 0 <= tokens_range[0] <= tokens_range[1]:
            raise ValueError(
                f"bad tokens_range {tokens_range!r}: use (low, high), 0 <= low <= high"
            )
        self.tokens_range = tokens_range
        if len({k.secret for k in keys}) != len(keys) or len({k.name for k in keys}) != len(keys):
            raise ValueError("loopback keys need distinct names and secrets")
        self.states = {k.secret: KeyState(k) for k in keys}
        self.latency, self.sigma, self.error_rate, self.tokens = latency, sigma, error_rate, tokens
        self.rng, self.seed = random.Random(seed), seed
        self.log: list[tuple[Any, ...]] = []
        self.unknown_key = self.log_dropped = 0
        for state in self.states.values():
            state.reset()

    def record(self, entry: tuple[Any, ...]) -> None:
        if len(self.log) < MAX_LOG:
            self.log.append(entry)
        else:
            self.log_dropped += 1

    async def answer(self, request: Request) -> tuple[int, dict[str, str], Any]:
        """(status, extra headers, JSON body) for one request."""
        if request.path.startswith("/_"):
            return self.admin(request)
        start = time.time()
        body = _json_object(request.body)
        job, attempt = _job_of(body, request.headers)
        state = self.states.get(request.headers.get("authorization", "").removeprefix("Bearer "))
        if state is None:
            self.unknown_key += 1
            self.record(("?", job, attempt, start, time.time(), 401, 0))
            return 401, {}, {"error": "invalid API key"}
        latency = _number(body.get("latency"), self._draw_latency(body.get("i")))
        state.count("requests")
        tokens = int(_number(body.get("tokens"), self._draw_tokens()))
        now = time.monotonic()
        wait = state.admit(now, latency, tokens)
        if wait is not None:
            self.record((state.key.name, job, attempt, start, time.time(), 429, 0))
            headers = {"Retry-After": f"{wait:.3f}", "Retry-After-Ms": str(math.ceil(wait * 1e3)),
                       **state.headers(now)}  # fmt: skip
            return 429, headers, {"error": "rate limited", "retry_after": round(wait, 3)}
        limits = state.headers(now)
        try:
            await asyncio.sleep(latency)
        finally:
            state.release(now + latency)  # before the answer is written: a client that frees
            # the key on reading it and sends the next call at once is not seen as over C
        status = 500 if self.error_rate and self.rng.random() < self.error_rate else 200
        state.count("ok" if status == 200 else "http_500")
        state.count("tokens", tokens)  # counted at admission, answered 200 or 500
        self.record((state.key.name, job, attempt, start, time.time(), status, tokens))
        if status == 500:
            return 500, limits, {"error": "internal error (simulated)"}
        body = {"job": job, "attempt": attempt, "usage": {"total_tokens": tokens}}
        return 200, limits, body

    def _draw_latency(self, item: Any) -> float:
        """An admitted call's latency: the item's own with a seed (see the module), else the
        next draw."""
        rng = self.rng
        if self.seed is not None and isinstance(item, int) and not isinstance(item, bool):
            rng = random.Random(f"{self.seed}:{item}")
        return rng.lognormvariate(math.log(self.latency), self.sigma)

    def _draw_tokens(self) -> float:
        if self.tokens_range is None:
            return float(self.tokens)
        return float(self.rng.randint(*self.tokens_range))

    def admin(self, request: Request) -> tuple[int, dict[str, str], Any]:
        url = urlsplit(request.path)
        if url.path == "/_stats":
            return 200, {}, self.stats()
        if url.path == "/_log":
            since = int(parse_qs(url.query).get("since", ["0"])[0])
            rows = self.log[since:]
            return 200, {}, {"fields": LOG_FIELDS, "rows": rows, "next": since + len(rows)}
        if url.path == "/_reset" and request.method == "POST":
            self.log.clear()
            self.unknown_key = self.log_dropped = 0
            for state in self.states.values():
                state.reset()
            return 200, {}, {"reset": True}
        if url.path == "/_health":
            return 200, {}, {"ok": True}
        return 404, {}, {"error": f"no such endpoint {url.path}"}

    def stats(self) -> dict[str, Any]:
        keys = {s.key.name: s.stats() for s in self.states.values()}
        return {"keys": keys, "unknown_key": self.unknown_key, "log_entries": len(self.log),
                "log_dropped": self.log_dropped,
                "latency": self.latency, "sigma": self.sigma, "error_rate": self.error_rate,
                "mean_latency": mean_latency(self.latency, self.sigma)}  # fmt: skip

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one connection: requests one after another until the client closes it."""
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    break
                status, headers, body = await self.answer(request)
                close = request.headers.get("connection", "").lower() == "close"
                writer.write(_response(status, headers, body, close=close))
                await writer.drain()
                if close:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:  # the service is stopping: end the connection quietly
            pass
        except ValueError:  # a malformed request: answer it and hang up
            writer.write(_response(400, {}, {"error": "bad request"}, close=True))
        finally:
            writer.close()

    async def serve(self, host: str, port: int, ready: asyncio.Future[int] | None = None) -> None:
        """Serve until cancelled; ``ready`` gets the port once listening."""
        server = await asyncio.start_server(self.connection, host, port, backlog=4096)
        async with server:
            if ready is not None:
                ready.set_result(server.sockets[0].getsockname()[1])
            await server.serve_forever()


# --- HTTP/1.1 on streams ----------------------------------------------------------------------


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise ValueError("truncated request head") from None
        return None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError(f"bad request line {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError("bad header line")
            headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise ValueError("chunked request bodies are not supported")
    length = int(headers.get("content-length", "0"))
    if not 0 <= length <= MAX_BODY:
        raise ValueError("bad content length")
    body = await reader.readexactly(length) if length else b""
    return Request(parts[0], parts[1], headers, body)


def _response(status: int, headers: dict[str, str], body: Any, *, close: bool) -> bytes:
    payload = json.dumps(body, separators=(",", ":")).encode()
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}",
             "Content-Type: application/json", f"Content-Length: {len(payload)}",
             f"Connection: {'close' if close else 'keep-alive'}",
             *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload


def _json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _job_of(body: dict[str, Any], headers: dict[str, str]) -> tuple[Any, Any]:
    return body.get("job", headers.get("x-job-id")), body.get("attempt", headers.get("x-attempt"))


def _number(value: Any, default: float) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return default


# --- running it in its own process ------------------------------------------------------------


def load_keys(data: Any) -> list[LoopKey]:
    """Keys from JSON: a list of objects with name, secret, concurrency and optional rate and
    period (or ``{"keys": [...]}``)."""
    items = data["keys"] if isinstance(data, dict) else data
    return [LoopKey(str(k["name"]), str(k["secret"]), int(k["concurrency"]),
                    None if k.get("rate") is None else int(k["rate"]),
                    float(k.get("period", 60.0)),
                    None if k.get("tpm") is None else int(k["tpm"]),
                    float(k.get("token_period", 60.0)),
                    None if k.get("true_concurrency") is None else int(k["true_concurrency"]),
                    None if k.get("true_rate") is None else int(k["true_rate"]))
            for k in items]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m harvest.loopback", description=__doc__)
    parser.add_argument("--keys", required=True, help="JSON file of keys, '-' for stdin")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
    parser.add_argument("--latency", type=float, default=0.5, help="median seconds per call")
    parser.add_argument("--sigma", type=float, default=SIGMA, help="lognormal shape")
    parser.add_argument("--error-rate", type=float, default=0.0, help="share answered 500")
    parser.add_argument("--tokens", type=int, default=100, help="tokens reported per call")
    parser.add_argument("--tokens-range", default=None, metavar="LOW-HIGH",
                        help="tokens per call drawn uniformly from LOW..HIGH")  # fmt: skip
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    text = sys.stdin.read() if args.keys == "-" else Path(args.keys).read_text()
    spread = None
    if args.tokens_range:
        low, _, high = args.tokens_range.partition("-")
        spread = (int(low), int(high))
    service = Loopback(load_keys(json.loads(text)), latency=args.latency, sigma=args.sigma,
                       error_rate=args.error_rate, tokens=args.tokens,
                       tokens_range=spread, seed=args.seed)  # fmt: skip
    asyncio.run(_run(service, args.host, args.port))


async def _run(service: Loopback, host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[int] = loop.create_future()
    task = asyncio.create_task(service.serve(host, port, ready))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    bound = await asyncio.wait_for(asyncio.shield(ready), 30)
    print(f"http://{host}:{bound}", flush=True)
    with contextlib.suppress(asyncio.CancelledError):
        await task


@dataclass
class LoopbackHandle:
    """A loopback service running in its own process."""

    url: str
    proc: subprocess.Popen[bytes]
    keys: tuple[LoopKey, ...]

    def _get(self, path: str) -> Any:
        response = httpx.get(f"{self.url}{path}", timeout=60)
        response.raise_for_status()
        return response.json()

    def stats(self) -> dict[str, Any]:
        return dict(self._get("/_stats"))

    def log(self, since: int = 0) -> list[dict[str, Any]]:
        """The call log from entry ``since``, as dicts of :data:`LOG_FIELDS`."""
        data = self._get(f"/_log?since={since}")
        return [dict(zip(data["fields"], row, strict=True)) for row in data["rows"]]

    def reset(self) -> None:
        httpx.post(f"{self.url}/_reset", timeout=60).raise_for_status()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> LoopbackHandle:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()


def start_loopback(keys: Sequence[LoopKey], *, latency: float, sigma: float = SIGMA,
                   error_rate: float = 0.0, tokens: int = 100,
                   tokens_range: tuple[int, int] | None = None, seed: int | None = None,
                   ready_timeout: float = 30.0) -> LoopbackHandle:  # fmt: skip
    """Start the service in its own process on a free loopback port (secrets go by stdin).

    :param keys: the keys it accepts and the limits it enforces on each.
    :param latency: median seconds an admitted call takes (lognormal, shape ``sigma``).
    :param error_rate: share of admitted calls answered 500.
    :param tokens: tokens each call uses (``usage.total_tokens``).
    :param tokens_range: tokens per call drawn uniformly from ``(low, high)`` instead.
    :param seed: seed of its random draws, for a repeatable run.
    """
    argv = [
        sys.executable,
        "-m",
        "harvest.loopback",
        "--keys",
        "-",
        "--port",
        "0",
        "--latency",
        str(latency),
        "--sigma",
        str(sigma),
        "--error-rate",
        str(error_rate),
        "--tokens",
        str(tokens),
        *(["--seed", str(seed)] if seed is not None else []),
        *(["--tokens-range", f"{tokens_range[0]}-{tokens_range[1]}"] if tokens_range else []),
    ]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps([asdict(k) for k in keys]).encode())
    proc.stdin.close()
    with _stop_on_error(proc):
        readable, _, _ = select.select([proc.stdout], [], [], ready_timeout)
        line = proc.stdout.readline().decode().strip() if readable else ""
        if not line.startswith("http://"):
            raise RuntimeError(f"the loopback service did not start (exit {proc.poll()})")
    return LoopbackHandle(line, proc, tuple(keys))


@contextlib.contextmanager
def _stop_on_error(proc: subprocess.Popen[bytes]) -> Iterator[None]:
    try:
        yield
    except BaseException:
        proc.kill()
        proc.wait(5)
        raise


if __name__ == "__main__":
    main()
