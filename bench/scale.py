"""Scenario ``scale`` (issue 16, item 4 and the measurement half of item 2).

Part 1, what each role costs per job. N no-op jobs go through real workers (as ``e2e`` runs
them), one role at a time, and each phase is measured on its own:

1. enqueue one at a time (``app.enqueue``, N/10 of the jobs), then ``enqueue_many`` (the rest),
   with no worker running;
2. dispatch: a schedule worker and beat alone claim every pending row and publish the messages
   (the in-flight window is set to N so that they do not wait for execution room);
3. execution: one execution worker (``-c 2``) alone runs the messages;
4. all roles together, as in production: the full worker set, enqueue_many N, drain.

For each phase: Postgres transactions (``pg_stat_database.xact_commit``), rows inserted,
updated and deleted (``tup_*``), WAL bytes (``pg_current_wal_lsn()`` before and after), the
peak of connections (``pg_stat_activity``, sampled every 50 ms: held, and active), Postgres's
CPU time (the private server's processes, from /proc) and Redis commands (``INFO
commandstats``). WAL position and Redis's counts are server-wide, and the
shared development servers carry other people's traffic, so this part runs on a Postgres and a
Redis of its own, started here with harvest's dev servers and removed afterwards (if they
cannot start, the shared ones are used and the rows say so). Statistics are read after the
phase's processes have exited (a backend flushes its counters when it exits; an idle one can
hold them for up to 10 s). A CHECKPOINT runs before each phase, so every phase pays the
full-page images of the pages it touches first: the WAL figures are on the high side of a
steady state.

Part 2, a large finished history (issue 16, item 2: the partitioned history of migration 0013).

1. Claim latency (one batch of 100, ``store.claim_due`` as the dispatcher calls it, rolled back so
   every claim sees the same 10,000 pending rows in ``harvest_jobs``) with an empty history and
   with H succeeded jobs in ``harvest_job_history``: its day partitions made first
   (``history_rows.make_partition``, one per UTC day of HISTORY_DAYS whole days), then one
   ``INSERT ... SELECT generate_series`` into the parent, which routes the rows. Two databases,
   claimed from in turn, rep by rep.
2. Retention with the partitioned history: ``harvest.maintenance.prune`` with a retention past
   which exactly the oldest day has ended. Timed, with the rows that day held, the partitions
   dropped and the dead tuples left on the history's partitions (none expected).
3. Baseline, the old design, in a third database: as many finished jobs as a day partition
   held (with an attempt row each) in ``harvest_jobs``, deleted by ``prune``'s batched DELETEs
   (the move leaves them: they are past retention). Timed, with the dead tuples it
   leaves and the VACUUM that pays them.
4. The move: a day's worth of finished jobs (with an attempt row each), ended in the last
   hour, moved from ``harvest_jobs`` into the history by ``maintenance.move_history``: jobs/s,
   and WAL bytes per job from a CHECKPOINT on. Autovacuum is off on the tables involved, so the
   WAL and the dead tuples are the move's own; the VACUUM of what it leaves in ``harvest_jobs``
   is timed after it.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import redis

from bench.claim import dispatch_claim
from bench.core import BenchTimeout, Comparison, Deadline, Row, Target, percentile
from bench.env import Ctx
from bench.jobs import NOOP
from bench.subjects import CHUNK

HISTORY_FULL = 10_000_000
HISTORY_QUICK = 200_000
HISTORY_DAYS = 10
PENDING = 10_000
CLAIM_BATCH = 100
SETTLE = 1.0  # after the processes of a phase exited, before the counters are read
SAMPLE_EVERY = 0.05

JOB_TABLES = ("harvest_jobs", "harvest_job_attempts")

# t spreads n rows evenly over [start, start + span seconds), in id order.
_SPREAD = """
    FROM (SELECT %(start)s::timestamptz
                 + make_interval(secs => (i - 0.5)::float8 * %(span)s::float8 / %(n)s::float8) AS t
          FROM generate_series(1, %(n)s) AS i) AS s
"""
# Succeeded jobs in the history as a move leaves them (ids from harvest_jobs's identity).
HISTORY_SQL = (
    """
INSERT INTO harvest_job_history (id, name, status, attempts, run_at, created_at, dispatched_at,
                                 started_at, finished_at, worker, attempt_log, moved_at)
SELECT nextval(pg_get_serial_sequence('harvest_jobs', 'id')), 'bench.noop', 'succeeded', 1,
       t, t, t, t, t, 'bench@scale',
       jsonb_build_array(jsonb_build_object('attempt', 1, 'worker', 'bench@scale',
           'started_at', t, 'ended_at', t, 'outcome', 'succeeded', 'error', NULL)),
       t + interval '5 minutes'
"""
    + _SPREAD
)
FINISHED_SQL = (
    """
INSERT INTO harvest_jobs (name, status, attempts, run_at, created_at, dispatched_at, started_at,
                          finished_at, worker)
SELECT 'bench.noop', 'succeeded', 1, t, t, t, t, t, 'bench@scale'
"""
    + _SPREAD
)
ATTEMPTS_SQL = """
INSERT INTO harvest_job_attempts (job_id, attempt, worker, started_at, ended_at, outcome)
SELECT id, 1, worker, started_at, finished_at, 'succeeded' FROM harvest_jobs
WHERE status = 'succeeded'
"""
PENDING_SQL = "INSERT INTO harvest_jobs (name) SELECT 'bench.noop' FROM generate_series(1, %s)"


# --- servers of the scenario's own ------------------------------------------------------------


@dataclass(frozen=True)
class Servers:
    admin_url: str  # libpq URL of the admin database
    redis_url: str
    private: bool
    postgres_pid: int = 0  # the private postmaster (its CPU and its children's are read)

    def db_url(self, name: str) -> str:
        return self.admin_url.rsplit("/", 1)[0] + f"/{name}"


@contextlib.contextmanager
def private_servers(ctx: Ctx) -> Iterator[Servers]:
    """A Postgres and a Redis of this scenario's own (harvest's dev servers, in a temporary
    folder removed afterwards); the shared ones, marked so, when they cannot start."""
    from harvest.dev.postgres_server import start_postgres
    from harvest.dev.redis_server import start_redis
    from harvest.dev.stopping import stop_all

    root = Path(tempfile.mkdtemp(prefix="harvest-bench-scale-"))
    records: list[Any] = []
    try:
        try:
            notes: list[str] = []
            records.append(start_postgres(root, "auto", 60.0, notes))
            records.append(start_redis(root, "auto", 30.0))
        except Exception as exc:  # no binaries, no permission: the shared servers then
            stop_all(tuple(records), 30.0)
            records.clear()
            ctx.step(f"scale: private servers unavailable ({type(exc).__name__}): shared ones")
            yield Servers(ctx.services.admin_url, ctx.redis_url, private=False)
            return
        token = ctx.reaper.register(lambda: stop_all(tuple(records), 30.0))
        try:
            pg, rd = records
            yield Servers(
                f"postgresql://postgres@127.0.0.1:{pg.port}/postgres",
                f"redis://127.0.0.1:{rd.port}/0",
                private=True,
                postgres_pid=pg.pid,
            )
        finally:
            ctx.reaper.release(token)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def new_database(servers: Servers, ctx: Ctx, tag: str) -> tuple[str, str, str]:
    """(name, libpq URL, SQLAlchemy URL) of a new database on ``servers``, dropped at the end."""
    if not servers.private:
        db = ctx.database(tag)
        return db.name, db.url, db.sa_url
    name = f"harvest_bench_scale_{tag}"
    with psycopg.connect(servers.admin_url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    url = servers.db_url(name)
    return name, url, url.replace("postgresql://", "postgresql+psycopg://", 1)


# --- counters ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counters:
    at: float
    xact_commit: int
    xact_rollback: int
    inserted: int
    updated: int
    deleted: int
    wal_lsn: str
    redis_calls: dict[str, int]
    tables: dict[str, tuple[int, int, int, int]]  # relname: (ins, upd, hot upd, del)
    postgres_cpu: float  # seconds of CPU of the whole private server; nan on a shared one


def read_counters(servers: Servers, database: str, rclient: redis.Redis) -> Counters:
    # A fresh connection to the admin database: nothing of it is counted in ``database``.
    with psycopg.connect(servers.admin_url, autocommit=True, connect_timeout=10) as conn:
        row = conn.execute(
            "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted,"
            " pg_current_wal_lsn()::text FROM pg_stat_database WHERE datname = %s",
            (database,),
        ).fetchone()
    assert row is not None
    stats: dict[str, Any] = rclient.info("commandstats")
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    # One transaction in ``database`` (after its xact_commit was read: see Phase.polls).
    with psycopg.connect(servers.db_url(database), autocommit=True, connect_timeout=10) as conn:
        tables = {
            str(r[0]): (int(r[1]), int(r[2]), int(r[3]), int(r[4]))
            for r in conn.execute(
                "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del"
                " FROM pg_stat_user_tables"
            )
        }
    cpu = postgres_cpu(servers.postgres_pid)
    return Counters(time.monotonic(), *(int(x) for x in row[:5]), str(row[5]), calls, tables, cpu)


def postgres_cpu(pid: int) -> float:
    """CPU seconds (user + system) the server has used: the postmaster, its exited children
    (backends, autovacuum workers: reaped, so counted in its children's times) and its live
    ones. nan when there is no private server to read."""
    if not pid:
        return math.nan
    import psutil

    try:
        root = psutil.Process(pid)
        t = root.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                c = child.cpu_times()
                total += c.user + c.system
    except psutil.Error:
        return math.nan
    return float(total)


class PeakSampler:
    """The most connections to ``database`` seen at once (held, and active) while it runs,
    not counting ``exclude`` (the backend pid of our own progress polls)."""

    def __init__(self, servers: Servers, database: str, exclude: int = 0) -> None:
        self.servers, self.database, self.exclude = servers, database, exclude
        self.held = self.active = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with psycopg.connect(self.servers.admin_url, autocommit=True) as conn:
            while not self._stop.is_set():
                row = conn.execute(
                    "SELECT count(*), count(*) FILTER (WHERE state NOT LIKE 'idle%%')"
                    " FROM pg_stat_activity WHERE datname = %s AND pid <> %s"
                    " AND backend_type = 'client backend'",
                    (self.database, self.exclude),
                ).fetchone()
                if row is not None:
                    self.held = max(self.held, int(row[0]))
                    self.active = max(self.active, int(row[1]))
                self._stop.wait(SAMPLE_EVERY)


@dataclass
class Phase:
    """One measured phase: its counters before and after, per job."""

    role: str
    jobs: int
    note: str = ""
    seconds: float = 0.0
    # Our own queries in the database, taken out of xact_commit: the progress polls, and the
    # per-table read of the "before" snapshot.
    polls: int = 1
    info_calls: int = 1  # the "before" INFO commandstats read, counted in "after": taken out
    peak_held: int = 0
    peak_active: int = 0
    costs: dict[str, float] = field(default_factory=dict)
    redis_top: dict[str, float] = field(default_factory=dict)
    tables: dict[str, dict[str, float]] = field(default_factory=dict)  # writes per job

    def settle(self, before: Counters, after: Counters) -> None:
        n = max(1, self.jobs)
        self.seconds = after.at - before.at
        xacts = after.xact_commit - before.xact_commit - self.polls
        redis_delta = {
            k: v - before.redis_calls.get(k, 0)
            for k, v in after.redis_calls.items()
            if v - before.redis_calls.get(k, 0) > 0
        }
        if "info" in redis_delta:
            redis_delta["info"] -= self.info_calls
        redis_total = sum(redis_delta.values())
        self.costs = {
            "xacts": xacts / n,
            "rollbacks": (after.xact_rollback - before.xact_rollback) / n,
            "inserted": (after.inserted - before.inserted) / n,
            "updated": (after.updated - before.updated) / n,
            "deleted": (after.deleted - before.deleted) / n,
            "wal_bytes": _lsn(after.wal_lsn) - _lsn(before.wal_lsn),
            "redis": redis_total / n,
            "postgres_cpu_us": (after.postgres_cpu - before.postgres_cpu) * 1e6 / n,
        }
        self.costs["wal_bytes"] /= n
        self.costs["rows"] = self.costs["inserted"] + self.costs["updated"] + self.costs["deleted"]
        top = sorted(redis_delta.items(), key=lambda kv: -kv[1])[:6]
        self.redis_top = {k: round(v / n, 3) for k, v in top if v}
        for rel, now in after.tables.items():
            was = before.tables.get(rel, (0, 0, 0, 0))
            d = [a - b for a, b in zip(now, was, strict=True)]
            if any(d):
                keys = ("ins", "upd", "hot_upd", "del")
                self.tables[rel] = {k: round(v / n, 3) for k, v in zip(keys, d, strict=True)}


def _lsn(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) + int(lo, 16)


# --- part 1: per-job costs ----------------------------------------------------------------------


def _group(ctx: Ctx, env: dict[str, str], tag: str, start: Callable[[Any], object]) -> int:
    """Start harvest processes (``start(group)``), ready; returns the reaper's token that
    stops them (:func:`_stop`)."""
    from harvest.procs import ProcessGroup

    group = ProcessGroup(env, ctx.log_dir / f"{tag}-{time.strftime('%H%M%S')}")
    token = ctx.reaper.register(group.stop)
    try:
        start(group)
        group.wait_ready(90.0)
    except BaseException:
        ctx.reaper.release(token)
        raise
    return token


def _stop(ctx: Ctx, token: int) -> None:
    ctx.reaper.release(token)


def costs(ctx: Ctx, servers: Servers) -> list[Phase]:
    from harvest import Harvest
    from harvest.settings import Settings

    n = ctx.cfg.jobs
    singles = max(100, n // 10)
    warm = min(n, 200 if ctx.cfg.quick else 2000)
    name, url, sa_url = new_database(servers, ctx, "costs")
    settings = Settings(database_url=sa_url, redis_url=servers.redis_url)
    from harvest.migrate import upgrade

    upgrade(settings, "head")
    rclient = redis.Redis.from_url(servers.redis_url, socket_timeout=10)
    ctx.later(rclient.close)
    poll = psycopg.connect(url, autocommit=True)
    ctx.later(poll.close)
    env = {
        "HARVEST_DATABASE_URL": sa_url,
        "HARVEST_REDIS_URL": servers.redis_url,
        "HARVEST_IMPORTS": "bench.jobs",
        **ctx.cfg.harvest_knobs,
    }

    def left(status_sql: str) -> int:
        row = poll.execute(f"SELECT count(*) FROM harvest_jobs WHERE {status_sql}").fetchone()
        assert row is not None
        return int(row[0])

    def wait_for(phase: Phase, status_sql: str, jobs: int) -> None:
        deadline = Deadline(jobs / 25 + 90)
        while True:
            phase.polls += 1
            if left(status_sql) == 0:
                return
            if deadline.passed():
                raise BenchTimeout(f"scale: {phase.role}: rows still {status_sql} at the deadline")
            time.sleep(0.1)

    unfinished = "status NOT IN ('succeeded', 'failed', 'cancelled')"

    def client() -> Any:
        app = Harvest(settings)
        app.load_imports(["bench.jobs"])
        return app

    def fresh_start() -> None:
        """Only the last 500 finished jobs kept (harvest sizes messages from them), a vacuumed
        table, a checkpoint: every phase starts from the same state."""
        poll.execute(
            "DELETE FROM harvest_jobs WHERE id NOT IN (SELECT id FROM harvest_jobs"
            " WHERE status = 'succeeded' ORDER BY finished_at DESC LIMIT 500)"
        )
        poll.execute("VACUUM ANALYZE harvest_jobs")
        poll.execute("CHECKPOINT")

    def measured(phase: Phase, body: Callable[[], None]) -> Phase:
        before = read_counters(servers, name, rclient)
        with PeakSampler(servers, name, poll.info.backend_pid) as peak:
            body()
        time.sleep(SETTLE)
        after = read_counters(servers, name, rclient)
        phase.peak_held, phase.peak_active = peak.held, peak.active
        phase.settle(before, after)
        ctx.step(f"scale: {phase.role}: {phase.costs['xacts']:.2f} xacts/job", 1)
        return phase

    # warm-up: the full worker set drains a few jobs (imports, caches, run-time history)
    ctx.step(f"scale: warm-up ({warm:,} jobs)")
    group = _group(ctx, env, "warm", lambda g: g.up(execution=1, concurrency=2))
    app = client()
    app.enqueue_many(NOOP, [{}] * warm, chunk_size=CHUNK)
    app.close()
    wait_for(Phase("warm-up", warm), unfinished, warm)
    _stop(ctx, group)
    fresh_start()

    phases = []
    ctx.step(f"scale: enqueue one at a time ({singles:,})")

    def enqueue_singles() -> None:
        app = client()
        for _ in range(singles):
            app.enqueue(NOOP, {})
        app.close()

    phases.append(measured(Phase("enqueue (one at a time)", singles), enqueue_singles))

    ctx.step(f"scale: enqueue_many ({n - singles:,})")
    poll.execute("CHECKPOINT")

    def enqueue_bulk() -> None:
        app = client()
        app.enqueue_many(NOOP, [{}] * (n - singles), chunk_size=CHUNK)
        app.close()

    phases.append(
        measured(Phase("enqueue_many", n - singles, f"chunks of {CHUNK:,}"), enqueue_bulk)
    )

    poll.execute("CHECKPOINT")
    ctx.step(f"scale: dispatch of {n:,} (schedule worker + beat)")
    dispatch = Phase("dispatch + claim", n, "schedule worker (-c 1) + beat; window = N")

    def run_dispatch() -> None:
        knobs = {**env, "HARVEST_INFLIGHT_WINDOW": str(n + 1000)}
        group = _group(ctx, knobs, "dispatch", lambda g: (g.worker("schedule", 1), g.beat()))
        try:
            wait_for(dispatch, "status = 'pending'", n)
            # The last claim has committed; let its task publish the messages before the
            # stop (a SIGTERM to the group reaches the pool's children too).
            time.sleep(2.0)
        finally:
            _stop(ctx, group)

    phases.append(measured(dispatch, run_dispatch))

    poll.execute("CHECKPOINT")
    ctx.step(f"scale: execution of {n:,} (execution worker -c 2)")
    execution = Phase("execution", n, "one execution worker, prefork -c 2, no-op handler")

    def run_execution() -> None:
        group = _group(ctx, env, "execution", lambda g: g.worker("execution", 2))
        try:
            wait_for(execution, unfinished, n)
        finally:
            _stop(ctx, group)

    phases.append(measured(execution, run_execution))
    if left("status = 'failed'"):
        raise RuntimeError("scale: some no-op jobs failed")

    fresh_start()
    ctx.step(f"scale: all roles together ({n:,} jobs)")
    together = Phase(
        "all roles together", n, "enqueue_many + full worker set; includes idle ticks and stop"
    )
    idle = Phase("idle worker set, per second", 1, "schedule + execution (-c 2) + beat, no jobs")
    group = _group(ctx, env, "together", lambda g: g.up(execution=1, concurrency=2))
    try:
        time.sleep(11)  # let the start's counters flush (an idle backend holds them up to 10 s)
        idle_seconds = 3.0 if ctx.cfg.quick else 30.0
        before = read_counters(servers, name, rclient)
        with PeakSampler(servers, name, poll.info.backend_pid) as peak:
            time.sleep(idle_seconds)
        mid = read_counters(servers, name, rclient)
        idle.settle(before, mid)
        idle.costs = {k: v / idle_seconds for k, v in idle.costs.items()}
        idle.redis_top = {k: round(v / idle_seconds, 3) for k, v in idle.redis_top.items()}
        idle.tables = {
            t: {k: round(v / idle_seconds, 3) for k, v in d.items()} for t, d in idle.tables.items()
        }
        idle.peak_held, idle.peak_active = peak.held, peak.active

        with PeakSampler(servers, name, poll.info.backend_pid) as peak:
            app = client()
            app.enqueue_many(NOOP, [{}] * n, chunk_size=CHUNK)
            app.close()
            wait_for(together, unfinished, n)
    finally:
        _stop(ctx, group)
    time.sleep(SETTLE)
    after = read_counters(servers, name, rclient)
    together.peak_held, together.peak_active = peak.held, peak.active
    together.settle(mid, after)
    phases += [together, idle]
    ctx.step("scale: costs measured", 1)
    return phases


# --- part 2: claim, retention and the move with a large history ---------------------------------


@dataclass
class History:
    size: int
    days: int = HISTORY_DAYS
    fill_seconds: float = 0.0
    table_bytes: int = 0  # the history's day partitions, with their indexes
    partitions: int = 0
    claims_empty: list[list[float]] = field(default_factory=list)  # per rep, ms
    claims_full: list[list[float]] = field(default_factory=list)
    claims_after_drop: list[float] = field(default_factory=list)
    # retention with the partitioned history: maintenance.prune drops the oldest day
    drop_rows: int = 0  # rows of the dropped partition
    drop_seconds: float = 0.0
    dropped: int = 0  # PruneReport.dropped
    drop_dead: int = 0  # dead tuples on the history's partitions after it
    drop_vacuum_seconds: float = 0.0  # a VACUUM of the history after it (nothing to do)
    # baseline, the old design: the same day of finished rows in harvest_jobs, batched DELETEs
    base_rows: int = 0
    base_seconds: float = 0.0
    base_statements: int = 0
    base_dead: dict[str, int] = field(default_factory=dict)  # table: dead tuples left
    base_vacuum_seconds: float = 0.0
    # the move of a day's finished jobs from harvest_jobs into the history
    move_rows: int = 0
    move_seconds: float = 0.0
    move_wal: int = 0  # bytes
    move_dead: dict[str, int] = field(default_factory=dict)
    move_vacuum_seconds: float = 0.0
    move_vacuum_wal: int = 0


class _Claimer:
    """A database of its own (migrated) and claims of one batch on it, as the dispatcher runs
    them, each rolled back so that every claim sees the same pending rows."""

    def __init__(self, servers: Servers, ctx: Ctx, tag: str) -> None:
        from harvest.db import make_engine
        from harvest.migrate import upgrade
        from harvest.settings import Settings

        self.name, self.url, sa_url = new_database(servers, ctx, tag)
        self.settings = Settings(database_url=sa_url, redis_url=servers.redis_url)
        upgrade(self.settings, "head")
        self.engine = make_engine(self.settings, pool_size=1)
        ctx.later(self.engine.dispose)

    def claim(self, sa_conn: Any) -> float:
        """One claim of CLAIM_BATCH on ``sa_conn``, rolled back: its time in ms."""
        tx = sa_conn.begin()
        started = time.perf_counter()
        got = dispatch_claim(sa_conn, self.settings, CLAIM_BATCH)
        elapsed = (time.perf_counter() - started) * 1000
        tx.rollback()
        if len(got) != CLAIM_BATCH:
            raise RuntimeError(f"claimed {len(got)} rows, expected {CLAIM_BATCH}")
        return elapsed

    def measure(self, count: int) -> list[float]:
        with self.engine.connect() as sa_conn:
            return [self.claim(sa_conn) for _ in range(count)]


def _interleaved(a: _Claimer, b: _Claimer, count: int) -> tuple[list[float], list[float]]:
    """``count`` claims on each of two databases, in turn (a b, b a, a b, ...): a change in the
    machine's load, and the order within a pair, weigh on both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    with a.engine.connect() as conn_a, b.engine.connect() as conn_b:
        pair = ((a, conn_a, times[0]), (b, conn_b, times[1]))
        for i in range(count):
            for claimer, conn, out in pair if i % 2 == 0 else pair[::-1]:
                out.append(claimer.claim(conn))
    return times


def history(ctx: Ctx, servers: Servers) -> History:
    size = ctx.cfg.scale_history or (HISTORY_QUICK if ctx.cfg.quick else HISTORY_FULL)
    out = History(max(size, HISTORY_DAYS))
    claims = 50 if ctx.cfg.quick else 200
    # Two databases, the same 10,000 pending rows in each, the history in one: their claims
    # alternate rep by rep, so a change in the machine's load weighs on both alike. A third
    # holds the baseline (the old design: a day of finished rows in harvest_jobs).
    empty, full = _Claimer(servers, ctx, "empty"), _Claimer(servers, ctx, "history")
    base: _Claimer | None = None
    conn = psycopg.connect(full.url, autocommit=True)
    try:
        start = _first_day(conn, out.days)
        _fill_history(ctx, out, full, conn, start)
        with psycopg.connect(empty.url, autocommit=True) as other:
            other.execute(PENDING_SQL, (PENDING,))
            other.execute("VACUUM ANALYZE harvest_jobs")
        _claims(ctx, out, empty, full, claims)
        _partitioned_retention(ctx, out, full, conn, start)
        ctx.step("scale: claims right after the partition drop")
        out.claims_after_drop = full.measure(claims)
        ctx.step("scale: retention measured", 1)
        base = _Claimer(servers, ctx, "baseline")
        _delete_baseline(ctx, out, base, start)
        _move(ctx, out, full, conn)
    finally:
        conn.close()
        if servers.private:  # on the shared server, ctx drops its databases
            with psycopg.connect(servers.admin_url, autocommit=True) as admin:
                for claimer in (empty, full, base):
                    if claimer is not None:
                        claimer.engine.dispose()
                        admin.execute(f'DROP DATABASE IF EXISTS "{claimer.name}" WITH (FORCE)')
    return out


def _first_day(conn: psycopg.Connection[Any], days: int) -> datetime:
    """The UTC midnight ``days`` days before today's: the history covers whole days from it
    to today's midnight, so that each day partition holds the same number of rows."""
    row = conn.execute(
        "SELECT date_trunc('day', now(), 'UTC') - make_interval(days => %s)", (days,)
    ).fetchone()
    assert row is not None
    day: datetime = row[0]
    return day.astimezone(UTC)


def _fill_history(
    ctx: Ctx, out: History, full: _Claimer, conn: psycopg.Connection[Any], start: datetime
) -> None:
    from harvest.store import history_rows

    ctx.step(f"scale: {out.days} day partitions of the history, then {out.size:,} jobs into it")
    for day in range(out.days):
        with full.engine.begin() as sa_conn:
            history_rows.make_partition(sa_conn, "done", start + timedelta(days=day))
    started = time.monotonic()
    conn.execute(HISTORY_SQL, {"start": start, "span": out.days * 86_400.0, "n": out.size})
    out.fill_seconds = time.monotonic() - started
    conn.execute(PENDING_SQL, (PENDING,))  # after the history: newer ids, as in production
    ctx.step("scale: VACUUM ANALYZE (as autovacuum would)")
    conn.execute("VACUUM ANALYZE harvest_jobs")
    conn.execute("VACUUM ANALYZE harvest_job_history")
    row = conn.execute(
        "SELECT count(*), coalesce(sum(pg_total_relation_size(relid)), 0)"
        " FROM pg_partition_tree('harvest_job_history') WHERE isleaf"
    ).fetchone()
    assert row is not None
    out.partitions, out.table_bytes = int(row[0]), int(row[1])
    ctx.step("scale: history filled", 1)


def _claims(ctx: Ctx, out: History, empty: _Claimer, full: _Claimer, claims: int) -> None:
    _interleaved(empty, full, 10)  # warm
    for rep in range(ctx.cfg.reps):
        ctx.step(f"scale: claims, empty history and {out.size:,} in it, rep {rep + 1}")
        times_empty, times_full = _interleaved(empty, full, claims)
        out.claims_empty.append(times_empty)
        out.claims_full.append(times_full)
    ctx.step("scale: claims measured", 1)


def _oldest_day_retention(conn: psycopg.Connection[Any], start: datetime) -> float:
    """A retention (seconds) past which exactly the oldest day (``start``) has ended: its end
    is an hour before the horizon, the next day's end is 23 hours after it."""
    row = conn.execute("SELECT extract(epoch FROM now() - %s)", (start,)).fetchone()
    assert row is not None
    return float(row[0]) - 86_400.0 - 3_600.0


def _partitioned_retention(
    ctx: Ctx, out: History, full: _Claimer, conn: psycopg.Connection[Any], start: datetime
) -> None:
    from harvest import Harvest
    from harvest.maintenance import prune
    from harvest.store import history_rows

    ctx.step("scale: retention of one day (harvest.maintenance.prune: a partition drop)")
    oldest = history_rows.partition_name("done", start)
    row = conn.execute(f"SELECT count(*) FROM {oldest}").fetchone()
    out.drop_rows = int(row[0]) if row else 0
    full.engine.dispose()  # the claims' backend exits: its counters are flushed
    retention = _oldest_day_retention(conn, start)
    app = Harvest(full.settings.model_copy(update={"retention_seconds": retention}))
    try:
        started = time.monotonic()
        report = prune(app, max_seconds=3600.0)
        out.drop_seconds = time.monotonic() - started
    finally:
        app.close()
    out.dropped = report.dropped
    gone = conn.execute("SELECT to_regclass(%s)", (oldest,)).fetchone()
    if report.dropped != 1 or (gone and gone[0] is not None) or report.total:
        raise RuntimeError(f"scale: retention dropped {report.dropped} partitions, not {oldest}")
    time.sleep(SETTLE)  # the pruning backend exited: its counters are flushed
    out.drop_dead = _history_dead(conn)
    started = time.monotonic()
    conn.execute("VACUUM harvest_job_history")
    out.drop_vacuum_seconds = time.monotonic() - started


def _delete_baseline(ctx: Ctx, out: History, base: _Claimer, start: datetime) -> None:
    """The old design, in a database of its own: the oldest day's finished jobs (as many as a
    day partition held, each with its attempt row) live in harvest_jobs, with the 10,000
    pending ones, and retention deletes them in batches."""
    from harvest import Harvest
    from harvest.maintenance import prune

    day = out.size // out.days
    ctx.step(f"scale: baseline: {day:,} finished jobs of one day in harvest_jobs")
    with psycopg.connect(base.url, autocommit=True) as conn:
        conn.execute(FINISHED_SQL, {"start": start, "span": 86_400.0, "n": day})
        conn.execute(ATTEMPTS_SQL)
        conn.execute(PENDING_SQL, (PENDING,))
        conn.execute("VACUUM ANALYZE harvest_jobs")
        conn.execute("VACUUM ANALYZE harvest_job_attempts")
        _autovacuum_off(conn, JOB_TABLES)  # the dead tuples read are the DELETEs' own
        time.sleep(SETTLE)
        dead = _dead_tuples(conn, JOB_TABLES)
        ctx.step("scale: baseline: retention of one day (maintenance.prune: batched DELETEs)")
        retention = _oldest_day_retention(conn, start)
        app = Harvest(base.settings.model_copy(update={"retention_seconds": retention}))
        try:
            started = time.monotonic()
            report = prune(app, max_seconds=3600.0)
            out.base_seconds = time.monotonic() - started
        finally:
            app.close()
        out.base_rows = report.finished
        if report.finished != day or report.moved:
            raise RuntimeError(f"scale: baseline deleted {report.finished} of {day} rows")
        out.base_statements = -(-report.finished // base.settings.prune_batch_size)
        time.sleep(SETTLE)  # the deleting backend exited: its counters are flushed
        out.base_dead = _dead_tuples(conn, JOB_TABLES, since=dead)
        started = time.monotonic()
        conn.execute(f"VACUUM {', '.join(JOB_TABLES)}")
        out.base_vacuum_seconds = time.monotonic() - started
    ctx.step("scale: baseline measured", 1)


def _move(ctx: Ctx, out: History, full: _Claimer, conn: psycopg.Connection[Any]) -> None:
    """A day's worth of finished jobs (each with its attempt row), ended in the last hour,
    moved from harvest_jobs into the history by ``maintenance.move_history`` as maintenance
    runs it: its time, and its WAL from a CHECKPOINT on (full-page images included, as in
    part 1). Autovacuum is off on the tables involved, so the WAL and the dead tuples are the
    move's own; the VACUUM that then pays harvest_jobs's dead tuples is measured after it."""
    from harvest import Harvest
    from harvest.maintenance import move_history
    from harvest.store import history_rows

    n = out.size // out.days
    ctx.step(f"scale: move: {n:,} finished jobs into harvest_jobs")
    full.engine.dispose()  # the claims' backend exits: its counters are flushed before the VACUUM
    time.sleep(SETTLE)
    row = conn.execute("SELECT now() - interval '70 minutes'").fetchone()
    assert row is not None
    conn.execute(FINISHED_SQL, {"start": row[0], "span": 3600.0, "n": n})  # ended 70-10 min ago
    conn.execute(ATTEMPTS_SQL)
    conn.execute("VACUUM ANALYZE harvest_jobs")
    conn.execute("VACUUM ANALYZE harvest_job_attempts")
    # The day partitions the move fills, made now (maintenance would make them in the move)
    # so that autovacuum can be turned off on them too.
    days = conn.execute(
        "SELECT DISTINCT date_trunc('day', finished_at, 'UTC') FROM harvest_jobs"
        " WHERE status = 'succeeded'"
    ).fetchall()
    for (day,) in days:
        with full.engine.begin() as sa_conn:
            if not history_rows.has_partition(sa_conn, "done", day.astimezone(UTC)):
                history_rows.make_partition(sa_conn, "done", day.astimezone(UTC))
    leaves = [
        str(r[0])
        for r in conn.execute(
            "SELECT relid::regclass::text FROM pg_partition_tree('harvest_job_history')"
            " WHERE isleaf"
        )
    ]
    _autovacuum_off(conn, (*JOB_TABLES, *leaves))
    full.engine.dispose()
    time.sleep(SETTLE)
    dead = _dead_tuples(conn, JOB_TABLES)
    retention = 30 * 86_400.0  # every row of the move is well within it
    app = Harvest(full.settings.model_copy(update={"retention_seconds": retention}))
    try:
        ctx.step(f"scale: move of {n:,} jobs into the history (maintenance.move_history)")
        conn.execute("CHECKPOINT")
        wal = _wal(conn)
        started = time.monotonic()
        moved = move_history(app, "done", retention, time.monotonic() + 3600.0)
        out.move_seconds = time.monotonic() - started
        out.move_wal = _wal(conn) - wal
    finally:
        app.close()
    out.move_rows = moved
    if moved != n:
        raise RuntimeError(f"scale: moved {moved} of {n} finished jobs")
    time.sleep(SETTLE)  # the moving backend exited: its counters are flushed
    out.move_dead = _dead_tuples(conn, JOB_TABLES, since=dead)
    wal = _wal(conn)
    started = time.monotonic()
    conn.execute(f"VACUUM {', '.join(JOB_TABLES)}")
    out.move_vacuum_seconds = time.monotonic() - started
    out.move_vacuum_wal = _wal(conn) - wal
    ctx.step("scale: move measured", 1)


def _autovacuum_off(conn: psycopg.Connection[Any], tables: tuple[str, ...]) -> None:
    for table in tables:
        conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = off)")


def _wal(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return _lsn(str(row[0]))


def _dead_tuples(
    conn: psycopg.Connection[Any], tables: tuple[str, ...], since: dict[str, int] | None = None
) -> dict[str, int]:
    """n_dead_tup of each of ``tables`` (less its value in ``since``)."""
    rows = conn.execute(
        "SELECT relname, n_dead_tup FROM pg_stat_user_tables WHERE relname = ANY(%s)",
        (list(tables),),
    ).fetchall()
    was = since or {}
    return {str(r[0]): int(r[1]) - was.get(str(r[0]), 0) for r in rows}


def _history_dead(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT coalesce(sum(s.n_dead_tup), 0) FROM pg_partition_tree('harvest_job_history') AS p"
        " JOIN pg_stat_user_tables AS s ON s.relid = p.relid WHERE p.isleaf"
    ).fetchone()
    return int(row[0]) if row else -1


# --- rows -------------------------------------------------------------------------------------


def _cost_rows(phases: list[Phase], private: bool) -> list[Row]:
    where = "own Postgres + Redis" if private else "SHARED servers: WAL and Redis include others"
    rows = []
    for p in phases:
        unit = "WAL B/s" if p.role.startswith("idle") else "WAL B/job"
        row = Row(
            "scale",
            f"cost: {p.role}",
            unit,
            values=[round(p.costs["wal_bytes"], 1)],
            higher_is_better=False,
            note=f"{p.note}; {where}".strip("; "),
        )
        row.extra["scale_cost"] = {
            "role": p.role,
            "jobs": p.jobs,
            "seconds": round(p.seconds, 2),
            "peak_connections": p.peak_held,
            "peak_active_connections": p.peak_active,
            **{k: round(v, 3) for k, v in p.costs.items()},
            "redis_top": p.redis_top,
            "tables": p.tables,
            "private_servers": private,
        }
        rows.append(row)
    return rows


def _history_rows(h: History) -> list[Row]:
    label = f"{h.size / 1e6:g}M" if h.size >= 1_000_000 else f"{h.size // 1000}k"
    base = "claim b=100, empty history"
    empty = Row("scale", base, "ms", higher_is_better=False,
                note=f"{PENDING:,} pending; median of each rep's p50")  # fmt: skip
    full = Row(
        "scale",
        f"claim b=100, {label} in the history",
        "ms",
        higher_is_better=False,
        comparisons=[Comparison(base, Target("ratio_max", 1.2, "≤ 1.2x (issue 16)"), "vs empty")],
        note=(
            f"harvest_job_history, {h.partitions} day partitions "
            f"({h.table_bytes / 2**30:.2f} GiB); {PENDING:,} pending in harvest_jobs"
        ),
    )
    for row, runs in ((empty, h.claims_empty), (full, h.claims_full)):
        row.values = [round(statistics.median(r), 3) for r in runs]
        row.extra["claims_per_rep"] = len(runs[0]) if runs else 0
        row.extra["p95_ms"] = [round(percentile(r, 95), 3) for r in runs]
    full.extra["fill_seconds"] = round(h.fill_seconds, 1)
    full.extra["table_bytes"] = h.table_bytes
    full.extra["partitions"] = h.partitions
    after = Row(
        "scale",
        "claim b=100, right after retention",
        "ms",
        values=[round(statistics.median(h.claims_after_drop), 3)] if h.claims_after_drop else [],
        higher_is_better=False,
        comparisons=[Comparison(base, None, "vs empty")],
        note="after the partition drop",
        extra={"p95_ms": [round(percentile(h.claims_after_drop, 95), 3)]}
        if h.claims_after_drop
        else {},
    )
    retention = Row(
        "scale",
        "retention of one day (partition drop)",
        "s",
        values=[round(h.drop_seconds, 3)],
        higher_is_better=False,
        target=Target("value_max", 1.0, "< 1 s (issue 16)"),
        note=(
            f"maintenance.prune: {h.dropped} partition of {h.drop_rows:,} rows dropped; "
            f"baseline below"
        ),
        extra={"rows": h.drop_rows, "partitions_dropped": h.dropped},
    )
    dead = Row(
        "scale",
        "dead tuples after retention (history)",
        "rows",
        values=[float(h.drop_dead)],
        higher_is_better=False,
        target=Target("value_max", 0.0, "0 (no vacuum debt)"),
        note=(
            f"n_dead_tup over the history's partitions; a VACUUM after it: "
            f"{h.drop_vacuum_seconds:.2f} s"
        ),
        extra={"vacuum_seconds": round(h.drop_vacuum_seconds, 3)},
    )
    base_dead = h.base_dead.get("harvest_jobs", -1)
    baseline = Row(
        "scale",
        "baseline: retention of one day (DELETE)",
        "s",
        values=[round(h.base_seconds, 2)],
        higher_is_better=False,
        note=(
            f"old design: {h.base_rows:,} rows of harvest_jobs in {h.base_statements:,} "
            f"statements of maintenance.prune"
        ),
        extra={"rows": h.base_rows, "statements": h.base_statements},
    )
    baseline_dead = Row(
        "scale",
        "baseline: dead tuples after DELETE",
        "rows",
        values=[float(base_dead)],
        higher_is_better=False,
        note=(
            f"harvest_jobs ({h.base_dead.get('harvest_job_attempts', -1):,} more in "
            f"harvest_job_attempts); the VACUUM that pays them: {h.base_vacuum_seconds:.1f} s"
        ),
        extra={"dead_tuples": h.base_dead, "vacuum_seconds": round(h.base_vacuum_seconds, 2)},
    )
    per_job = max(1, h.move_rows)
    move_rate = Row(
        "scale",
        "move to the history",
        "jobs/s",
        values=[round(h.move_rows / h.move_seconds, 1)] if h.move_seconds else [],
        note=f"maintenance.move_history of {h.move_rows:,} jobs in {h.move_seconds:.1f} s",
        extra={"rows": h.move_rows, "seconds": round(h.move_seconds, 2)},
    )
    move_wal = Row(
        "scale",
        "move to the history, WAL",
        "B/job",
        values=[round(h.move_wal / per_job, 1)],
        higher_is_better=False,
        note=(
            f"from a CHECKPOINT; leaves {h.move_dead.get('harvest_jobs', -1):,} dead tuples in "
            f"harvest_jobs (+{h.move_dead.get('harvest_job_attempts', -1):,} attempts): VACUUM "
            f"{h.move_vacuum_seconds:.1f} s, {h.move_vacuum_wal / per_job:.0f} B/job of WAL"
        ),
        extra={
            "wal_bytes": h.move_wal,
            "dead_tuples": h.move_dead,
            "vacuum_seconds": round(h.move_vacuum_seconds, 2),
            "vacuum_wal_bytes": h.move_vacuum_wal,
        },
    )
    return [empty, full, after, retention, dead, baseline, baseline_dead, move_rate, move_wal]


def run(ctx: Ctx) -> list[Row]:
    ctx.plan(5 + 5)
    rows: list[Row] = []
    with private_servers(ctx) as servers:
        ctx.step("scale: servers ready")
        phases = costs(ctx, servers)
        rows += _cost_rows(phases, servers.private)
        ctx.record(*rows)
        h = history(ctx, servers)
        rows += _history_rows(h)
        ctx.record(*rows)
    return rows
