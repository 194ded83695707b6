"""The systems under test for the end-to-end scenarios, behind one small interface: start their
workers, empty their queue, enqueue N no-op jobs in bulk, and say how many are left.

Each uses its own fresh database and Redis db number, and the same process budget: two
processes that run jobs. harvest also runs what its architecture needs besides (a schedule
worker and beat), as a user would.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import psycopg

from bench import jobs as bench_jobs
from bench import jobs_pooled
from bench.baselines import plain
from bench.core import BenchTimeout, Deadline, wait_for
from bench.env import Ctx, Database, python_m

T = TypeVar("T")
EXECUTION_PROCESSES = 2
CHUNK = 5000
KEYS = 8


class Subject(Protocol):
    name: str

    def start(self) -> None: ...
    def reset(self) -> None: ...
    def enqueue(self, n: int) -> None: ...
    def progress(self) -> tuple[int, int]: ...  # (left to run, failed)


@dataclass
class DrainRun:
    jobs: int
    seconds: float
    enqueue_seconds: float

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds


def drain(subject: Subject, n: int, *, min_rate: float = 25.0) -> DrainRun:
    """Empty the subject's queue, enqueue ``n`` jobs in bulk, and time until all have run
    (from the start of the enqueue). Bounded: ``n / min_rate + 60`` seconds."""
    subject.reset()
    started = time.perf_counter()
    subject.enqueue(n)
    enqueued = time.perf_counter() - started
    deadline = Deadline(n / min_rate + 60)
    while True:
        left, failed = subject.progress()
        now = time.perf_counter()
        if failed:
            raise RuntimeError(f"{subject.name}: {failed} of {n} no-op jobs failed")
        if left == 0:
            return DrainRun(n, now - started, enqueued)
        if deadline.passed():
            raise BenchTimeout(f"{subject.name}: {left} of {n} jobs still not run at the deadline")
        # Poll fast near the end (the finish time is read to ~20 ms), slowly before it.
        rate = (n - left) / max(now - started, 1e-3)
        time.sleep(min(0.25, max(0.02, left / max(rate, 1.0) / 4)))


# --- harvest ---------------------------------------------------------------------------------


@dataclass
class HarvestSubject:
    ctx: Ctx
    knobs: Mapping[str, str]
    name: str = "harvest"
    job: str = bench_jobs.NOOP
    pool_keys: int = 0  # > 0: a key pool of that many keys gates the job
    tag: str = "harvest"
    imports: str = "bench.jobs"  # the module of the job, as HARVEST_IMPORTS
    execution: tuple[str, ...] = ()  # the execution worker's pool options (none: prefork -c 2)
    db: Database | None = None
    client: Any = None
    conn: psycopg.Connection[Any] | None = None

    def start(self) -> None:
        from harvest import Harvest

        if self.db is not None:  # started already
            return
        self.db = self.ctx.database(self.tag)
        redis_url = self.ctx.redis_url_of(self.ctx.new_redis_db())  # its own broker queues
        extra: dict[str, Any] = {}
        if "HARVEST_SECRET_KEY" in self.knobs:
            extra["secret_key"] = self.knobs["HARVEST_SECRET_KEY"]
        settings = self.ctx.migrated(self.db, redis_url, **extra)
        self.client = Harvest(settings)
        self.client.load_imports([self.imports])
        self.ctx.later(self.client.close)
        if self.pool_keys:
            load_key_pool(self.client, self.pool_keys)
        self.conn = psycopg.connect(self.db.url, autocommit=True)
        self.ctx.later(self.conn.close)
        if not self.execution:
            self.ctx.harvest_workers(settings, self.knobs, tag=self.tag, imports=self.imports)
            return
        env = {"HARVEST_DATABASE_URL": settings.database_url, "HARVEST_REDIS_URL": redis_url,
               "HARVEST_IMPORTS": self.imports, **self.knobs}  # fmt: skip
        self.ctx.harvest_workers_with(env, self.execution, tag=self.tag)

    def reset(self) -> None:
        """An empty queue, as a running system has between floods: every job gone but the
        last 500 finished, the history harvest sizes messages from (a job name with no
        recent run time travels one job a message, in case it is long)."""
        assert self.conn is not None
        self.conn.execute("SET lock_timeout = '20s'")
        self.conn.execute(
            "CREATE TEMP TABLE IF NOT EXISTS bench_recent AS SELECT * FROM harvest_jobs LIMIT 0"
        )
        self.conn.execute("TRUNCATE bench_recent")
        self.conn.execute(
            "INSERT INTO bench_recent SELECT * FROM harvest_jobs"
            " WHERE status IN ('succeeded', 'failed', 'cancelled')"
            " ORDER BY finished_at DESC LIMIT 500"
        )
        self.conn.execute("TRUNCATE harvest_jobs CASCADE")  # and the attempts (0007)
        self.conn.execute("INSERT INTO harvest_jobs SELECT * FROM bench_recent")
        self.conn.execute("VACUUM ANALYZE harvest_jobs")

    def enqueue(self, n: int) -> None:
        for start in range(0, n, 4 * CHUNK):
            count = min(4 * CHUNK, n - start)
            self.client.enqueue_many(self.job, [{}] * count, chunk_size=CHUNK)

    def progress(self) -> tuple[int, int]:
        assert self.conn is not None
        row = self.conn.execute(
            "SELECT count(*) FILTER (WHERE status NOT IN ('succeeded', 'failed', 'cancelled')),"
            " count(*) FILTER (WHERE status = 'failed') FROM harvest_jobs"
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def leases_granted(self) -> int:
        """How many key leases the pool has granted (its fence counter moved by as many)."""
        from harvest.coordination import keys

        value = self.client.redis.get(keys.pool_fence(jobs_pooled.POOL))
        return 0 if value is None else int(value)


def load_key_pool(client: Any, count: int) -> None:
    """``count`` keys in pool ``bench`` (no rate limit, room for every process), stored
    encrypted in Postgres by harvest's keystore and loaded into Redis."""
    from harvest import keystore

    cipher = keystore.Cipher.from_settings(client.settings)
    with client.sessions.begin() as session:
        for i in range(count):
            keystore.add_key(
                session,
                cipher,
                pool=jobs_pooled.POOL,
                name=f"key-{i}",
                secret=f"sk-bench-{secrets.token_hex(12)}",
                max_concurrency=64,
            )
    keystore.sync_pool(client.engine, client.redis, jobs_pooled.POOL)


# --- plain Celery ----------------------------------------------------------------------------


@dataclass
class CelerySubject:
    ctx: Ctx
    name: str = "plain Celery"
    app: Any = None
    redis: Any = None

    def start(self) -> None:
        from bench.baselines import celery_app

        redis_url = self.ctx.redis_url_of(self.ctx.new_redis_db())  # its own "unacked" hash
        self.app = celery_app.make_app(redis_url)
        self.ctx.later(self.app.close)
        self.redis = self.ctx.redis(redis_url)
        argv = [
            *python_m("celery"), "-A", "bench.baselines.celery_app", "worker",
            "-Q", celery_app.QUEUE, "-c", str(EXECUTION_PROCESSES), "--pool", "prefork",
            "-n", f"plain-{secrets.token_hex(3)}@%h", "-l", "WARNING",
            "--without-gossip", "--without-mingle",
        ]  # fmt: skip
        self.ctx.spawn("celery-plain", argv, {"BENCH_BROKER_URL": redis_url})
        wait_for(
            lambda: plain.READY in self.ctx.log_text("celery-plain", 100_000),
            timeout=90,
            what="the plain Celery worker to be ready",
        )

    def reset(self) -> None:
        wait_for(lambda: self.progress()[0] == 0, timeout=60, what="plain Celery to be idle")

    def enqueue(self, n: int) -> None:
        from bench.baselines import celery_app

        with self.app.producer_or_acquire() as producer:
            for _ in range(n):
                self.app.send_task(celery_app.TASK, queue=celery_app.QUEUE, producer=producer)

    def progress(self) -> tuple[int, int]:
        from bench.baselines import celery_app

        pipe = self.redis.pipeline(transaction=False)
        for name in celery_app.queue_keys():
            pipe.llen(name)
        pipe.hlen("unacked")
        return int(sum(pipe.execute())), 0


# --- procrastinate and PgQueuer (async clients, run on a private event loop) ------------------


@dataclass
class _Loop:
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout=300))

    def close(self) -> None:
        self.loop.close()


@dataclass
class ProcrastinateSubject:
    ctx: Ctx
    concurrency: int = 10
    name: str = "procrastinate"
    db: Database | None = None
    conn: psycopg.Connection[Any] | None = None
    loop: _Loop | None = None
    app: Any = None
    task: Any = None

    def start(self) -> None:
        from bench.baselines import procrastinate_worker

        self.db = self.ctx.database("procrastinate")
        self.loop = _Loop()
        self.ctx.later(self.loop.close)
        self.app = procrastinate_worker.make_app(self.db.url)
        self.task = self.app.tasks[procrastinate_worker.TASK]
        self.loop.run(self.app.open_async())
        self.ctx.later(lambda: self.loop.run(self.app.close_async()) if self.loop else None)
        self.loop.run(self.app.schema_manager.apply_schema_async())
        self.conn = psycopg.connect(self.db.url, autocommit=True)
        self.ctx.later(self.conn.close)
        env = {"BENCH_PG_URL": self.db.url, "BENCH_CONCURRENCY": str(self.concurrency)}
        for i in range(EXECUTION_PROCESSES):
            self.ctx.spawn(
                f"procrastinate-{i}", python_m("bench.baselines.procrastinate_worker"), env
            )
        for i in range(EXECUTION_PROCESSES):
            wait_for(
                lambda i=i: "bench-ready" in self.ctx.log_text(f"procrastinate-{i}"),
                timeout=60,
                what="procrastinate workers",
            )
        time.sleep(1.0)  # the worker registers and LISTENs after printing

    def reset(self) -> None:
        assert self.conn is not None
        wait_for(lambda: self.progress()[0] == 0, timeout=60, what="procrastinate to be idle")
        self.conn.execute("SET lock_timeout = '20s'")
        self.conn.execute("TRUNCATE procrastinate_jobs, procrastinate_events CASCADE")
        self.conn.execute("VACUUM ANALYZE procrastinate_jobs")

    def enqueue(self, n: int) -> None:
        assert self.loop is not None
        for start in range(0, n, CHUNK):
            count = min(CHUNK, n - start)
            self.loop.run(self.task.batch_defer_async(*([{}] * count)))

    def progress(self) -> tuple[int, int]:
        assert self.conn is not None
        row = self.conn.execute(
            "SELECT count(*) FILTER (WHERE status IN ('todo', 'doing')),"
            " count(*) FILTER (WHERE status = 'failed') FROM procrastinate_jobs"
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])


@dataclass
class PgQueuerSubject:
    ctx: Ctx
    batch: int = 10
    name: str = "PgQueuer"
    db: Database | None = None
    conn: psycopg.Connection[Any] | None = None
    loop: _Loop | None = None
    aconn: Any = None
    queries: Any = None

    def start(self) -> None:
        from pgqueuer import PsycopgDriver, Queries

        self.db = self.ctx.database("pgqueuer")
        self.loop = _Loop()
        self.ctx.later(self.loop.close)
        self.aconn = self.loop.run(psycopg.AsyncConnection.connect(self.db.url, autocommit=True))
        self.ctx.later(lambda: self.loop.run(self.aconn.close()) if self.loop else None)
        self.queries = Queries(PsycopgDriver(self.aconn))
        self.loop.run(self.queries.install())
        self.conn = psycopg.connect(self.db.url, autocommit=True)
        self.ctx.later(self.conn.close)
        env = {"BENCH_PG_URL": self.db.url, "BENCH_BATCH": str(self.batch)}
        for i in range(EXECUTION_PROCESSES):
            self.ctx.spawn(f"pgqueuer-{i}", python_m("bench.baselines.pgqueuer_worker"), env)
        for i in range(EXECUTION_PROCESSES):
            wait_for(
                lambda i=i: "bench-ready" in self.ctx.log_text(f"pgqueuer-{i}"),
                timeout=60,
                what="PgQueuer workers",
            )
        time.sleep(1.0)

    def reset(self) -> None:
        assert self.conn is not None
        wait_for(lambda: self.progress()[0] == 0, timeout=60, what="PgQueuer to be idle")
        self.conn.execute("SET lock_timeout = '20s'")
        self.conn.execute("TRUNCATE pgqueuer, pgqueuer_log")
        self.conn.execute("VACUUM ANALYZE pgqueuer")

    def enqueue(self, n: int) -> None:
        from bench.baselines.pgqueuer_worker import ENTRYPOINT

        assert self.loop is not None
        for start in range(0, n, CHUNK):
            count = min(CHUNK, n - start)
            self.loop.run(self.queries.enqueue([ENTRYPOINT] * count, [None] * count, [0] * count))

    def progress(self) -> tuple[int, int]:
        assert self.conn is not None
        row = self.conn.execute("SELECT count(*) FROM pgqueuer").fetchone()
        assert row is not None
        failed = 0
        with contextlib.suppress(psycopg.Error):
            bad = self.conn.execute(
                "SELECT count(*) FROM pgqueuer_log WHERE status = 'exception'"
            ).fetchone()
            failed = int(bad[0]) if bad else 0
        return int(row[0]), failed
