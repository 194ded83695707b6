"""The demo: harvest's main job end to end on one machine.

Brings services up (the embedded default when none are configured or answering), migrates,
starts a local HTTP service on loopback that behaves like a rate-limited AI API
(:mod:`harvest.loopback`: per-key concurrency and rate limits enforced by the service itself,
``429`` with ``Retry-After`` when a key goes over, answers after hundreds of milliseconds to a
couple of seconds, and about 2 % of ``500`` answers), loads a pool of demo keys, starts a
schedule worker, an execution worker and beat, enqueues a few thousand "harvest a page" jobs
(``async def`` handlers: each worker process keeps many calls in flight on its event loop),
waits for them, and stops everything it started. The CLI
(``harvest demo``) draws the progress bar and the summary; this module only does the work and
reports.

The keys' secrets are made up for the run and stored encrypted like any key; when
``HARVEST_SECRET_KEY`` is not set, an ephemeral master key is made for the run and handed to
the workers in their environment. Neither is ever printed. The demo's keys are removed at the
end (nobody could decrypt them later).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from cryptography.fernet import Fernet
from pydantic import SecretStr
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from harvest import dev, keystore, migrate, stats, store
from harvest.app import Harvest
from harvest.context import JobContext
from harvest.loopback import LoopbackHandle, LoopKey, start_loopback
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
LATENCY = 0.4  # median seconds the service takes to answer a call (lognormal, sigma 0.5)
SIGMA = 0.5
POLL = 0.5  # seconds between progress reports
DATABASE = "harvest_demo"  # the demo's own database: never harvest's default one

app = Harvest()


@app.job(
    JOB,
    pool=POOL,
    max_attempts=5,
    retry=RetryPolicy(base=0.2, factor=2.0, max_delay=2.0),
    timeout=30,
)
async def harvest_page(ctx: JobContext, url: str) -> dict[str, object]:
    """Fetch a page from the (demo) API with the leased key, awaiting the answer (the worker
    runs many of these at once). A 429 rests the key for its Retry-After and retries on another
    key without using up an attempt; a 500 is retried with backoff."""
    async with ctx.aclient() as http:
        response = await http.post(url, json={"job": ctx.job_id, "attempt": ctx.attempt})
    if response.status_code == 429:
        ctx.rate_limited(retry_after(response.headers.get("Retry-After")))
    response.raise_for_status()
    return {"url": url, "tokens": response.json()["usage"]["total_tokens"]}


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


# --- the service: the loopback AI API, in its own process --------------------------------------


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
    """The demo's keys on :mod:`harvest.loopback` (a rate-limited AI API on loopback): each key
    may have ``api_concurrency`` calls in flight and ``api_rate`` calls per period; beyond
    either the call is answered ``429`` with ``Retry-After``. Answers come after a lognormal
    time (median ``latency``); about ``error_rate`` of them are ``500``."""

    def __init__(
        self,
        keys: Mapping[str, DemoKey],
        *,
        error_rate: float = ERROR_RATE,
        latency: float = LATENCY,
    ) -> None:
        """
        :param keys: secret -> the key it is (the secrets go to the service's process on its
            standard input; nothing here prints them).
        """
        self.keys = dict(keys)
        self.error_rate, self.latency = error_rate, latency
        self._handle: LoopbackHandle | None = None
        self._last: dict[str, Any] = {}

    def start(self) -> str:
        """Start the service; returns its base URL."""
        loop_keys = [
            LoopKey(k.name, secret, k.api_concurrency, k.api_rate[0], k.api_rate[1])
            for secret, k in self.keys.items()
        ]
        self._handle = start_loopback(
            loop_keys, latency=self.latency, sigma=SIGMA, error_rate=self.error_rate
        )
        return self._handle.url

    def stop(self) -> None:
        if self._handle is not None:
            with contextlib.suppress(Exception):
                self._last = self._handle.stats()
            self._handle.stop()
            self._handle = None

    def _stats(self) -> dict[str, Any]:
        if self._handle is not None:
            with contextlib.suppress(httpx.HTTPError):
                self._last = self._handle.stats()
        return self._last

    @property
    def http_429(self) -> int:
        return sum(int(k["http_429"]) for k in self._stats().get("keys", {}).values())

    def report(self) -> tuple[KeyReport, ...]:
        seen = self._stats().get("keys", {})
        rows = []
        for key in sorted(self.keys.values(), key=lambda k: k.name):
            use = seen.get(key.name, {})
            counts = (int(use.get(n, 0)) for n in ("ok", "http_429", "http_500"))
            rows.append(KeyReport(key.name, key.max_concurrency, key.rate, key.api_limit, *counts))
        return tuple(rows)


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
    database: str = ""  # the demo's own database
    dropped: bool = False  # dropped at the end (else kept, with the run's jobs)

    @property
    def http_429(self) -> int:
        return sum(k.http_429 for k in self.keys)

    @property
    def http_500(self) -> int:
        return sum(k.http_500 for k in self.keys)


@dataclass(frozen=True, slots=True)
class DemoServices:
    """What the demo runs against, said before it starts (URLs redacted)."""

    settings: Settings = field(repr=False)
    postgres: str  # the demo's own database
    postgres_from: str
    redis: str
    redis_from: str
    logs: Path  # the workers' and beat's logs
    database_created: bool
    recorded: Path | None  # dev.json, written for the private servers started for the demo


@contextmanager
def services(
    database: str = DATABASE, *, drop: bool = False, log_dir: Path | None = None
) -> Iterator[DemoServices]:
    """The services the demo uses, with its own database (created when missing; dropped on
    exit with ``drop``). The machine's services are used without being recorded in dev.json;
    private servers started here are recorded (for `harvest dev down`) and stopped on exit."""
    before = dev.read_state()
    state = dev.up(record=False, database="postgres")  # creates nothing: ensure_database does
    started_here = bool(state.servers) and not (before and before.servers)
    try:
        # dev.json keeps URLs redacted: a URL from the environment is read from there, whole.
        pg = os.environ[dev.DATABASE_ENV] if state.database_source == "env" else state.database_url
        redis_url = os.environ[dev.REDIS_ENV] if state.redis_source == "env" else state.redis_url
        url, created = dev.ensure_database(pg, database)
        yield DemoServices(
            load_settings(database_url=url, redis_url=redis_url), redact_url(url),
            dev.describe(state, "postgres"), redact_url(redis_url), dev.describe(state, "redis"),
            log_dir or dev.state_dir() / "demo-logs", created,
            Path(state.state_dir) / dev.STATE_FILE if started_here else None,
        )  # fmt: skip
        if drop:
            dev.drop_database(url)
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
        batch = [{"url": f"{base_url}/v1/page/{i}"} for i in range(start, min(jobs, start + 500))]
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
    concurrency: int = 2,
    timeout: float = 600.0,
    log_dir: Path | None = None,
    database: str = DATABASE,
    drop: bool = False,
    on_services: Callable[[DemoServices], None] = lambda s: None,
    on_enqueued: Callable[[int], None] = lambda n: None,
    on_progress: Callable[[Progress], None] = lambda p: None,
) -> DemoResult:
    """The whole demo, in its own ``database`` (dropped at the end with ``drop``); everything
    it started is stopped before it returns (or raises)."""
    with services(database, drop=drop, log_dir=log_dir) as found:
        on_services(found)
        migrate.upgrade(found.settings)
        settings = with_secret_key(found.settings)
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
            found.logs,
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
                jobs, window, elapsed, unfinished, found.postgres, keys=api.report(),
                database=database, dropped=drop,
            )  # fmt: skip
        finally:
            group.stop()
            if api is not None:
                api.stop()
            _cleanup(client)
