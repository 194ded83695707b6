"""The systems the goodput scenario runs against the loopback AI-API service, behind one small
interface: start (processes up, keys known), submit N jobs, say how many are left, and name
the processes whose memory counts.

- harvest, ``async def`` handler (:data:`bench.jobs_goodput.CALL`) on prefork ``-c 2`` (with
  ``HARVEST_ASYNC_CONCURRENCY`` raised when 100 a process would not cover the keys) or solo;
- harvest, sync handler on ``-P threads -c <keys x C>``, and on prefork ``-c 2`` (the default);
- the asyncio script a user writes instead (:mod:`bench.baselines.asyncio_script`);
- plain Celery on ``-P gevent -c 64`` with round-robin keys (:mod:`bench.baselines.celery_gevent`).

Each harvest subject has its own database and Redis db and a schedule worker and beat besides
its execution worker, as a user runs it; its keys are stored with their true limits. Its workers
run at ``-l INFO`` (the bench waits for Celery's "ready." line) with ``HARVEST_JOB_LOG=off``
(:data:`bench.cli.AS_THE_README`): the job lines a worker at the README's level (Celery's
default, WARNING) does not write; at INFO they cost huge 1-3 % of its jobs/s. Plain Celery runs
at WARNING.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Any, Protocol

import psycopg

from bench import jobs_goodput
from bench.baselines import plain
from bench.core import wait_for
from bench.env import Ctx, python_m
from harvest.loopback import LoopbackHandle, LoopKey
from harvest.procs import ProcessGroup

ASYNC_DEFAULT = 100  # HARVEST_ASYNC_CONCURRENCY's default: async jobs at once per process
PREFORK = 2


@dataclass(frozen=True)
class Case:
    """One scenario of keys: K keys of concurrency C and R calls per period, latency L."""

    name: str
    keys: int
    concurrency: int
    rate: int
    period: float
    latency: float  # median seconds (lognormal, sigma harvest.loopback.SIGMA)
    jobs: int
    cap: float  # seconds a subject may take from its first submit: then it is stopped
    tpm: int | None = None  # tokens per minute a key (None: no token budget)
    tokens: tuple[int, int] | None = None  # tokens a call uses, drawn uniformly from this range
    true_concurrency: int | None = None  # what the service really allows when below C (harvest
    # is told C: it has to learn the lower limit from 429s)

    def loop_keys(self) -> list[LoopKey]:
        return [
            LoopKey(f"key-{i}", f"sk-goodput-{secrets.token_hex(12)}", self.concurrency,
                    self.rate, self.period, self.tpm, true_concurrency=self.true_concurrency)
            for i in range(self.keys)
        ]  # fmt: skip

    @property
    def real_concurrency(self) -> int:
        """The concurrency the service enforces."""
        return self.true_concurrency or self.concurrency

    @property
    def mean_tokens(self) -> float:
        return (self.tokens[0] + self.tokens[1]) / 2 if self.tokens else 0.0

    @property
    def rate_text(self) -> str:
        """The rate as harvest is told it (``120/m``, ``20/10s``)."""
        return f"{self.rate}/m" if self.period == 60 else f"{self.rate}/{self.period:g}s"


class Subject(Protocol):
    name: str

    def start(self, ctx: Ctx, case: Case, service: LoopbackHandle) -> None: ...
    def submit(self, n: int) -> None: ...
    def left(self) -> int | None: ...  # jobs not finished by its own account (None: unknown)
    def failed(self) -> int: ...  # jobs it gave up on
    def pids(self) -> list[int]: ...  # its main processes (their children count too)


# --- harvest ----------------------------------------------------------------------------------


@dataclass
class HarvestGoodput:
    """harvest with one execution worker of ``pool`` (``async``: the async handler on prefork
    ``-c 2`` or ``solo``; ``threads``: the sync handler on threads; ``prefork``: sync, -c 2)."""

    mode: str  # async | threads | prefork
    async_pool: str = "prefork"
    knobs: dict[str, str] = field(default_factory=dict)
    name: str = ""
    group: ProcessGroup | None = None
    case: Case | None = None
    conn: Any = None
    client: Any = None
    settings_used: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name:
            self.name = {
                "async": f"harvest async ({self.async_pool})",
                "threads": "harvest sync threads",
                "prefork": "harvest prefork -c 2",
            }[self.mode]

    @property
    def job(self) -> str:
        if self.case is not None and self.case.tpm is not None:
            return (
                jobs_goodput.CALL_TOKENS if self.mode == "async" else jobs_goodput.CALL_TOKENS_SYNC
            )
        return jobs_goodput.CALL if self.mode == "async" else jobs_goodput.CALL_SYNC

    def start(self, ctx: Ctx, case: Case, service: LoopbackHandle) -> None:
        from cryptography.fernet import Fernet

        from harvest import Harvest, keystore

        self.case = case
        master = Fernet.generate_key().decode()
        db = ctx.database(f"gp_{self.mode}")
        settings = ctx.migrated(db, ctx.redis_url_of(ctx.new_redis_db()), secret_key=master)
        self.client = Harvest(settings)
        self.client.load_imports(["bench.jobs_goodput"])
        ctx.later(self.client.close)
        cipher = keystore.Cipher.from_settings(settings)
        with self.client.sessions.begin() as session:
            for key in service.keys:
                keystore.add_key(session, cipher, pool=jobs_goodput.POOL, name=key.name,
                                 secret=key.secret, max_concurrency=key.concurrency,
                                 rate_limit=case.rate_text, tpm=case.tpm)  # fmt: skip
        keystore.sync_pool(self.client.engine, self.client.redis, jobs_goodput.POOL)
        self.conn = psycopg.connect(db.url, autocommit=True)
        ctx.later(self.conn.close)
        self.settings_used = self._settings(case)
        env = {
            "HARVEST_DATABASE_URL": settings.database_url,
            "HARVEST_REDIS_URL": settings.redis_url,
            "HARVEST_IMPORTS": "bench.jobs_goodput",
            "HARVEST_SECRET_KEY": master,
            "BENCH_LOOPBACK_URL": service.url,
            **self.settings_used,
            **self.knobs,
        }
        self.group = ctx.harvest_workers_with(env, self._execution_args(case), tag=self.mode)

    def _settings(self, case: Case) -> dict[str, str]:
        """The one setting the async subject may need: enough async jobs per process to keep
        every key slot busy, and a quarter more for the jobs waiting at the gate for the next
        free key (the README's rule)."""
        if self.mode != "async":
            return {}
        processes = PREFORK if self.async_pool == "prefork" else 1
        per_process = math.ceil(case.keys * case.concurrency * 1.25 / processes)
        return (
            {"HARVEST_ASYNC_CONCURRENCY": str(per_process)} if per_process > ASYNC_DEFAULT else {}
        )

    def _execution_args(self, case: Case) -> list[str]:
        if self.mode == "threads":
            return ["--pool", "threads", "-c", str(case.keys * case.concurrency)]
        if self.mode == "async" and self.async_pool == "solo":
            return ["--pool", "solo"]
        return ["--pool", "prefork", "-c", str(PREFORK)]

    def submit(self, n: int) -> None:
        for start in range(0, n, 20_000):
            count = min(20_000, n - start)
            extra = {"max_tokens": self.case.tokens[1]} if self.case and self.case.tokens else {}
            payloads = [{"i": start + i, **extra} for i in range(count)]
            self.client.enqueue_many(self.job, payloads)

    def left(self) -> int | None:
        row = self.conn.execute(
            "SELECT count(*) FROM harvest_jobs"
            " WHERE status NOT IN ('succeeded', 'failed', 'cancelled')"
        ).fetchone()
        return int(row[0])

    def failed(self) -> int:
        row = self.conn.execute("SELECT count(*) FROM harvest_jobs WHERE status = 'failed'")
        return int(row.fetchone()[0])

    def pids(self) -> list[int]:
        return [p.pid for p in self.group.procs] if self.group else []


# --- the asyncio script -----------------------------------------------------------------------


@dataclass
class AsyncioScript:
    name: str = "asyncio script"
    ctx: Ctx | None = None
    env: dict[str, str] = field(default_factory=dict)
    proc: Any = None

    def start(self, ctx: Ctx, case: Case, service: LoopbackHandle) -> None:
        self.ctx = ctx
        keys = [
            {"secret": k.secret, "concurrency": k.concurrency, "rate": k.rate, "period": k.period}
            for k in service.keys
        ]
        self.env = {"BENCH_KEYS": json.dumps(keys), "BENCH_LOOPBACK_URL": service.url}

    def submit(self, n: int) -> None:
        assert self.ctx is not None
        env = {**self.env, "BENCH_JOBS": str(n)}
        self.proc = self.ctx.spawn(
            "asyncio-script", python_m("bench.baselines.asyncio_script"), env
        )

    def _summary(self) -> dict[str, Any] | None:
        assert self.ctx is not None
        for line in reversed(self.ctx.log_text("asyncio-script", 100_000).splitlines()):
            if line.startswith("{"):
                return dict(json.loads(line))
        return None

    def left(self) -> int | None:
        if self.proc is None or self.proc.poll() is None:
            return None
        return 0

    def failed(self) -> int:
        summary = self._summary()
        return int(summary["jobs"] - summary["succeeded"]) if summary else 0

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None and self.proc.poll() is None else []


# --- plain Celery on gevent -------------------------------------------------------------------


@dataclass
class CeleryGevent:
    concurrency: int = 64
    name: str = "Celery gevent -c 64"
    ctx: Ctx | None = None
    app: Any = None
    redis: Any = None
    proc: Any = None

    def start(self, ctx: Ctx, case: Case, service: LoopbackHandle) -> None:
        from bench.baselines import celery_gevent

        self.ctx = ctx
        redis_url = ctx.redis_url_of(ctx.new_redis_db())
        self.app = celery_gevent.make_app(redis_url)
        ctx.later(self.app.close)
        self.redis = ctx.redis(redis_url)
        env = {
            "BENCH_BROKER_URL": redis_url,
            "BENCH_KEYS": json.dumps([k.secret for k in service.keys]),
            "BENCH_LOOPBACK_URL": service.url,
        }
        argv = [
            *python_m("celery"), "-A", "bench.baselines.celery_gevent", "worker",
            "-Q", celery_gevent.QUEUE, "-P", "gevent", "-c", str(self.concurrency),
            "-n", f"gevent-{secrets.token_hex(3)}@%h", "-l", "WARNING",
            "--without-gossip", "--without-mingle",
        ]  # fmt: skip
        self.proc = ctx.spawn("celery-gevent", argv, env)
        wait_for(
            lambda: plain.READY in ctx.log_text("celery-gevent", 100_000),
            timeout=90,
            what="the gevent Celery worker to be ready",
        )

    def submit(self, n: int) -> None:
        from bench.baselines import celery_gevent

        with self.app.producer_or_acquire() as producer:
            for i in range(n):
                self.app.send_task(
                    celery_gevent.TASK, args=(i,), queue=celery_gevent.QUEUE, producer=producer
                )

    def left(self) -> int | None:
        from bench.baselines import celery_app, celery_gevent

        pipe = self.redis.pipeline(transaction=False)
        for name in celery_app.queue_keys(celery_gevent.QUEUE):
            pipe.llen(name)
        pipe.hlen("unacked")
        return int(sum(pipe.execute()))

    def failed(self) -> int:
        """Tasks that gave up: with no result backend, only the worker's log says so."""
        assert self.ctx is not None
        return self.ctx.log_text("celery-gevent", 50_000_000).count("raised unexpected")

    def pids(self) -> list[int]:
        return [self.proc.pid] if self.proc is not None else []


def make_subjects(names: list[str], async_pool: str, knobs: dict[str, str]) -> list[Subject]:
    every: dict[str, Subject] = {
        "async": HarvestGoodput("async", async_pool, dict(knobs)),
        "threads": HarvestGoodput("threads", knobs=dict(knobs)),
        "prefork": HarvestGoodput("prefork", knobs=dict(knobs)),
        "asyncio": AsyncioScript(),
        "celery": CeleryGevent(),
    }
    return [every[n] for n in names]


SUBJECTS = ("async", "threads", "prefork", "asyncio", "celery")
