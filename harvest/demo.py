"""The demo: harvest's main job end to end on one machine.

Brings services up (the embedded default when none are configured or answering), migrates,
starts a local HTTP service on loopback that behaves like a rate-limited AI API (per-key
concurrency and rate limits enforced by the service itself, ``429`` with ``Retry-After`` when a
key goes over, and about 2 % of ``500`` answers), loads a pool of demo keys, starts a schedule
worker, execution workers and beat, enqueues a few thousand "harvest a page" jobs that call the
service with a leased key, waits for them, and stops everything it started. The CLI
(``harvest demo``) draws the progress bar and the summary; this module only does the work and
reports.

The keys' secrets are made up for the run and stored encrypted like any key; when
``HARVEST_SECRET_KEY`` is not set, an ephemeral master key is made for the run and handed to
the workers in their environment. Neither is ever printed. The demo's keys are removed at the
end (nobody could decrypt them later).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import redis
from cryptography.fernet import Fernet
from pydantic import SecretStr
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from harvest import dev, keystore, migrate, stats, store
from harvest.app import Harvest
from harvest.context import JobContext
from harvest.models import JobStatus
from harvest.procs import ProcessGroup
from harvest.redact import redact_url
from harvest.retry import RetryPolicy
from harvest.settings import Settings, load_settings
from harvest.stats import summarize
from harvest.store import Window

log = logging.getLogger(__name__)

JOB = "demo.harvest_page"
POOL = "demo"
ERROR_RATE = 0.02  # share of calls the service answers with HTTP 500
LATENCY = (0.005, 0.02)  # seconds the service takes to answer a call
POLL = 0.5  # seconds between progress reports

app = Harvest()


@app.job(
    JOB,
    pool=POOL,
    max_attempts=5,
    retry=RetryPolicy(base=0.2, factor=2.0, max_delay=2.0),
    timeout=30,
)
def harvest_page(ctx: JobContext, url: str) -> dict[str, object]:
    """Fetch a page from the (demo) API with the leased key. A 429 rests the key for its
    Retry-After and retries on another key without using up an attempt; a 500 is retried
    with backoff."""
    with ctx.client() as http:
        response = http.get(url)
    if response.status_code == 429:
        ctx.rate_limited(retry_after(response.headers.get("Retry-After")))
    response.raise_for_status()
    page = response.json()
    return {"url": url, "bytes": page["bytes"]}


def retry_after(header: str | None) -> float:
    """Seconds from a Retry-After header (delay-seconds); 1 s when absent or unreadable."""
    try:
        value = float(header) if header is not None else 1.0
    except ValueError:
        return 1.0
    return value if math.isfinite(value) and value > 0 else 1.0


# --- the demo's keys ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DemoKey:
    """A key as harvest is told about it, and the limits the service really enforces."""

    name: str
    max_concurrency: int
    rate: str | None  # declared to harvest
    api_concurrency: int  # what the service allows at once
    api_rate: tuple[int, float]  # calls per seconds the service allows

    @property
    def api_limit(self) -> str:
        count, period = self.api_rate
        return f"{self.api_concurrency} at once, {count}/{period:g}s"


KEYS = (
    DemoKey("key-1", 16, "25/s", 16, (25, 1.0)),
    DemoKey("key-2", 16, "25/s", 16, (25, 1.0)),
    DemoKey("key-3", 8, "10/s", 8, (10, 1.0)),
    # Its limit is not declared: the service's 429s (and Retry-After) are what slow it down.
    DemoKey("key-4", 16, None, 16, (10, 1.0)),
)


# --- the service: a rate-limited API on loopback ----------------------------------------------


@dataclass
class _KeyUse:
    key: DemoKey
    in_flight: int = 0
    admitted: deque[float] = field(default_factory=deque)  # monotonic times, last period
    ok: int = 0
    http_429: int = 0
    http_500: int = 0


@dataclass(frozen=True, slots=True)
class KeyReport:
    """What the service saw of one key (by name: the secret is never kept or shown)."""

    name: str
    max_concurrency: int
    rate: str | None
    api_limit: str
    ok: int
    http_429: int
    http_500: int


class DemoApi:
    """A local HTTP service that behaves like a rate-limited AI API.

    Each key (a bearer token) may have ``api_concurrency`` calls in flight and ``api_rate``
    calls per period; a call over either is answered ``429`` with ``Retry-After`` (whole
    seconds) and does not count. About ``error_rate`` of admitted calls get a ``500``. Unknown
    keys get ``401``. Keys are held as SHA-256 digests only.
    """

    def __init__(
        self,
        keys: Mapping[str, DemoKey],
        *,
        error_rate: float = ERROR_RATE,
        latency: tuple[float, float] = LATENCY,
    ) -> None:
        """
        :param keys: secret -> the key it is (only digests of the secrets are kept).
        :param error_rate: share of admitted calls answered with HTTP 500.
        :param latency: (min, max) seconds an admitted call takes.
        """
        self._use = {_digest(s): _KeyUse(k) for s, k in keys.items()}
        self.error_rate, self.latency = error_rate, latency
        self._lock = threading.Lock()
        self._rng = random.Random()
        self._httpd: ThreadingHTTPServer | None = None

    # --- serving ----------------------------------------------------------------------------

    def start(self) -> str:
        """Serve on 127.0.0.1 (a free port) in a daemon thread; returns the base URL."""
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, name="demo-api", daemon=True).start()
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def answer(self, authorization: str) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) for one call carrying ``authorization``."""
        use = self._use.get(_digest(authorization.removeprefix("Bearer ")))
        if use is None:
            return 401, {}, b'{"error": "invalid API key"}'
        wait = self._admit(use)
        if wait is not None:
            return 429, {"Retry-After": str(wait)}, b'{"error": "rate limited"}'
        try:
            time.sleep(self._rng.uniform(*self.latency))
            failed = self._rng.random() < self.error_rate
        finally:
            with self._lock:
                use.in_flight -= 1
                use.http_500 += failed
                use.ok += not failed
        if failed:
            return 500, {}, b'{"error": "internal error (simulated)"}'
        body = {"bytes": self._rng.randint(1_000, 50_000)}
        return 200, {}, json.dumps(body).encode()

    def _admit(self, use: _KeyUse) -> int | None:
        """Count the call in (None), or the whole seconds to wait before trying again."""
        count, period = use.key.api_rate
        now = time.monotonic()
        with self._lock:
            while use.admitted and use.admitted[0] <= now - period:
                use.admitted.popleft()
            if len(use.admitted) >= count:
                use.http_429 += 1
                return max(1, math.ceil(use.admitted[0] + period - now))
            if use.in_flight >= use.key.api_concurrency:
                use.http_429 += 1
                return 1
            use.admitted.append(now)
            use.in_flight += 1
            return None

    # --- reading ----------------------------------------------------------------------------

    @property
    def http_429(self) -> int:
        with self._lock:
            return sum(u.http_429 for u in self._use.values())

    def report(self) -> tuple[KeyReport, ...]:
        with self._lock:
            uses = sorted(self._use.values(), key=lambda u: u.key.name)
            return tuple(_report(u) for u in uses)


def _report(use: _KeyUse) -> KeyReport:
    k = use.key
    return KeyReport(
        k.name, k.max_concurrency, k.rate, k.api_limit, use.ok, use.http_429, use.http_500
    )


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _handler(api: DemoApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: workers reuse their connections

        def do_GET(self) -> None:
            status, headers, body = api.answer(self.headers.get("Authorization", ""))
            self.send_response(status)
            for name, value in {"Content-Type": "application/json", **headers}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the demo prints only through the CLI

    return Handler


# --- the run ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Progress:
    done: int
    total: int
    succeeded: int
    failed: int
    running: int
    leases: int = 0  # key leases held now
    capacity: int = 0  # leases the pool allows at once
    cooling: int = 0  # keys resting after a 429
    http_429: int = 0  # 429s the service answered so far


@dataclass(frozen=True, slots=True)
class DemoResult:
    jobs: int
    window: Window
    elapsed: float
    unfinished: dict[str, int]
    services: str
    pool: str = POOL
    keys: tuple[KeyReport, ...] = ()

    @property
    def http_429(self) -> int:
        return sum(k.http_429 for k in self.keys)

    @property
    def http_500(self) -> int:
        return sum(k.http_500 for k in self.keys)


@contextmanager
def services() -> Iterator[Settings]:
    """Settings pointing at running services; stops on exit only what it started here."""
    before = dev.read_state()
    state = dev.up()
    started_here = bool(state.servers) and not (before and before.servers)
    try:
        yield load_settings(database_url=state.database_url, redis_url=state.redis_url)
    finally:
        if started_here:
            dev.down()


def with_secret_key(settings: Settings) -> Settings:
    """``settings`` with a master key: the configured one, else an ephemeral one for this run."""
    if settings.secret_key is not None and settings.secret_key.get_secret_value().strip():
        return settings
    return settings.model_copy(update={"secret_key": SecretStr(Fernet.generate_key().decode())})


def _master_key(settings: Settings) -> str:
    return settings.secret_key.get_secret_value() if settings.secret_key else ""


def install_keys(engine: Engine, client: redis.Redis, settings: Settings) -> dict[str, DemoKey]:
    """Replace the demo pool's keys with fresh ones (new made-up secrets) and load the pool
    into Redis. Returns secret -> key, for the service."""
    cipher = keystore.Cipher.from_settings(settings)
    made = {f"sk-demo-{secrets.token_urlsafe(24)}": key for key in KEYS}
    with Session(engine) as session, session.begin():
        conn = session.connection()
        for info in keystore.list_keys(conn, POOL):
            keystore.remove_key(conn, info.id)
        for secret, key in made.items():
            keystore.add_key(
                session, cipher, pool=POOL, name=key.name, secret=secret,
                max_concurrency=key.max_concurrency, rate_limit=key.rate,
            )  # fmt: skip
    keystore.sync_pool(engine, client, POOL)
    return made


def remove_keys(engine: Engine, client: redis.Redis) -> None:
    """Drop the demo pool's keys (their secrets were made up for the run)."""
    with engine.begin() as conn:
        for info in keystore.list_keys(conn, POOL):
            keystore.remove_key(conn, info.id)
    keystore.sync_pool(engine, client, POOL)


def _cleanup(client: Harvest) -> None:
    """Remove the demo's keys (best effort: the next demo replaces them) and close clients."""
    try:
        remove_keys(client.engine, client.redis)
    except Exception as exc:
        log.warning("demo keys not removed (%s); the next demo replaces them", type(exc).__name__)
    finally:
        client.close()


def _progress(app_: Harvest, ids: list[int], api: DemoApi) -> Progress:
    with app_.engine.connect() as conn:
        counts = store.status_counts(conn, ids)
    pools = stats.key_pools(app_.engine, app_.redis, [POOL])
    pool = pools[0] if pools else None
    return Progress(
        done=sum(counts.get(s, 0) for s in ("succeeded", "failed", "cancelled")),
        total=len(ids),
        succeeded=counts.get("succeeded", 0),
        failed=counts.get("failed", 0),
        running=counts.get("running", 0),
        leases=pool.leases if pool else 0,
        capacity=pool.capacity if pool else 0,
        cooling=pool.count("cooling") if pool else 0,
        http_429=api.http_429,
    )


def _enqueue(
    client: Harvest, base_url: str, jobs: int, on_enqueued: Callable[[int], None]
) -> list[int]:
    ids: list[int] = []
    for start in range(0, jobs, 500):
        batch = [{"url": f"{base_url}/page/{i}"} for i in range(start, min(jobs, start + 500))]
        ids += client.enqueue_many(JOB, batch)
        on_enqueued(len(ids))
    return ids


def _wait(
    client: Harvest,
    ids: list[int],
    api: DemoApi,
    deadline: float,
    on_progress: Callable[[Progress], None],
) -> None:
    while True:
        progress = _progress(client, ids, api)
        on_progress(progress)
        if progress.done == progress.total or time.monotonic() > deadline:
            return
        time.sleep(POLL)


def run(
    *,
    jobs: int = 3000,
    concurrency: int = 6,
    timeout: float = 600.0,
    log_dir: Path | None = None,
    on_enqueued: Callable[[int], None] = lambda n: None,
    on_progress: Callable[[Progress], None] = lambda p: None,
) -> DemoResult:
    """The whole demo; everything it started is stopped before it returns (or raises)."""
    with services() as found:
        migrate.upgrade(found)
        settings = with_secret_key(found)
        client = Harvest(settings)
        client.jobs.update(app.jobs)
        api: DemoApi | None = None
        group = ProcessGroup(
            {
                "HARVEST_DATABASE_URL": settings.database_url,
                "HARVEST_REDIS_URL": settings.redis_url,
                "HARVEST_IMPORTS": __name__,
                "HARVEST_SECRET_KEY": _master_key(settings),
                "HARVEST_WORKER_CONCURRENCY": str(concurrency),
            },
            log_dir or dev.state_dir() / "demo-logs",
        )
        try:
            api = DemoApi(install_keys(client.engine, client.redis, settings))
            base_url = api.start()
            group.up(execution=1, concurrency=concurrency)
            group.wait_ready()
            started = time.monotonic()
            ids = _enqueue(client, base_url, jobs, on_enqueued)
            _wait(client, ids, api, started + timeout, on_progress)
            elapsed = time.monotonic() - started
            window = summarize(client.engine, ids)
            with client.engine.connect() as conn:
                counts = store.status_counts(conn, ids)
            unfinished = {s: n for s, n in counts.items() if not JobStatus(s).terminal}
            return DemoResult(
                jobs, window, elapsed, unfinished, redact_url(settings.database_url),
                keys=api.report(),
            )  # fmt: skip
        finally:
            group.stop()
            if api is not None:
                api.stop()
            _cleanup(client)
