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

Part 2, a large finished history. Claim latency (one batch of 100, ``store.claim_due`` as the
dispatcher calls it, rolled back so every claim sees the same 10,000 pending rows) on an empty
history and with H finished jobs (one ``INSERT ... SELECT generate_series``, ``finished_at``
spread over 10 days): two databases, claimed from in turn, rep by rep. Then today's retention
(``harvest.maintenance.prune``: batched DELETEs) of the oldest day's rows, timed, with the dead
tuples it leaves (``n_dead_tup``) and the VACUUM that pays them. This is the baseline a
partitioned history (issue 16 item 2, not built) would replace with a partition drop.
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

FINISHED_SQL = """
INSERT INTO harvest_jobs (name, status, attempts, run_at, started_at, finished_at, created_at)
SELECT 'bench.noop', 'succeeded', 1, t, t, t, t
FROM (SELECT now() - make_interval(days => %(days)s) * (1 - i::float8 / %(n)s) AS t
      FROM generate_series(1, %(n)s) AS i) AS s
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
        idle_seconds = 10.0 if ctx.cfg.quick else 30.0
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


# --- part 2: claim and retention with a large history -------------------------------------------


@dataclass
class History:
    size: int
    days: int = HISTORY_DAYS
    fill_seconds: float = 0.0
    table_bytes: int = 0
    claims_empty: list[list[float]] = field(default_factory=list)  # per rep, ms
    claims_full: list[list[float]] = field(default_factory=list)
    claims_after_delete: list[float] = field(default_factory=list)
    retention_rows: int = 0
    retention_seconds: float = 0.0
    retention_statements: int = 0
    dead_tuples: int = 0  # left by the retention's DELETEs
    dead_tuples_total: int = 0  # on the table after it (the rolled-back claims leave some too)
    vacuum_seconds: float = 0.0


class _Claimer:
    """Claims of one batch on one database, as the dispatcher runs them, each rolled back so
    that every claim sees the same pending rows."""

    def __init__(self, servers: Servers, ctx: Ctx, tag: str) -> None:
        from harvest.db import make_engine
        from harvest.migrate import upgrade
        from harvest.settings import Settings

        self.name, self.url, sa_url = new_database(servers, ctx, tag)
        self.settings = Settings(database_url=sa_url, redis_url=servers.redis_url)
        upgrade(self.settings, "head")
        self.engine = make_engine(self.settings, pool_size=1)
        ctx.later(self.engine.dispose)

    def measure(self, count: int) -> list[float]:
        times = []
        with self.engine.connect() as sa_conn:
            for _ in range(count):
                tx = sa_conn.begin()
                started = time.perf_counter()
                got = dispatch_claim(sa_conn, self.settings, CLAIM_BATCH)
                times.append((time.perf_counter() - started) * 1000)
                tx.rollback()
                if len(got) != CLAIM_BATCH:
                    raise RuntimeError(f"claimed {len(got)} rows, expected {CLAIM_BATCH}")
        return times


def history(ctx: Ctx, servers: Servers) -> History:
    from harvest import Harvest
    from harvest.maintenance import prune

    size = ctx.cfg.scale_history or (HISTORY_QUICK if ctx.cfg.quick else HISTORY_FULL)
    claims = 50 if ctx.cfg.quick else 200
    out = History(size)
    # Two databases, the same 10,000 pending rows in each, the history in one: their claims
    # alternate rep by rep, so a change in the machine's load weighs on both alike.
    empty, full = _Claimer(servers, ctx, "empty"), _Claimer(servers, ctx, "history")
    conn = psycopg.connect(full.url, autocommit=True)
    try:
        with psycopg.connect(empty.url, autocommit=True) as other:
            other.execute(PENDING_SQL, (PENDING,))
            other.execute("VACUUM ANALYZE harvest_jobs")
        conn.execute(PENDING_SQL, (PENDING,))
        ctx.step(f"scale: filling {size:,} finished jobs (one INSERT ... SELECT)")
        started = time.monotonic()
        conn.execute(FINISHED_SQL, {"n": size, "days": out.days})
        out.fill_seconds = time.monotonic() - started
        ctx.step("scale: VACUUM ANALYZE of the history (as autovacuum would)")
        conn.execute("VACUUM ANALYZE harvest_jobs")
        row = conn.execute("SELECT pg_total_relation_size('harvest_jobs')").fetchone()
        out.table_bytes = int(row[0]) if row else 0
        ctx.step("scale: history filled", 1)

        empty.measure(10)  # warm
        full.measure(10)
        for rep in range(ctx.cfg.reps):
            ctx.step(f"scale: claims, empty history and {size:,} finished, rep {rep + 1}")
            out.claims_empty.append(empty.measure(claims))
            out.claims_full.append(full.measure(claims))
        ctx.step("scale: claims measured", 1)

        # today's retention: the oldest day is past a retention of (days - 1) days
        ctx.step("scale: retention of one day (harvest.maintenance.prune: batched DELETEs)")
        retention = (out.days - 1) * 86_400.0
        app = Harvest(full.settings.model_copy(update={"retention_seconds": retention}))
        full.engine.dispose()  # the claims' backend exits: its counters are flushed
        time.sleep(SETTLE)
        dead_before = _dead_tuples(conn)
        try:
            started = time.monotonic()
            report = prune(app, max_seconds=3600.0)
            out.retention_seconds = time.monotonic() - started
        finally:
            app.close()
        out.retention_rows = report.finished
        out.retention_statements = -(-report.finished // full.settings.prune_batch_size)
        time.sleep(SETTLE)  # the deleting backend exited: its counters are flushed
        out.dead_tuples_total = _dead_tuples(conn)
        out.dead_tuples = out.dead_tuples_total - dead_before
        ctx.step("scale: claims right after the retention (before any vacuum)")
        out.claims_after_delete = full.measure(claims)
        started = time.monotonic()
        conn.execute("VACUUM harvest_jobs")
        out.vacuum_seconds = time.monotonic() - started
        ctx.step("scale: retention measured", 1)
    finally:
        conn.close()
        if servers.private:  # on the shared server, ctx drops its databases
            empty.engine.dispose()
            full.engine.dispose()
            with psycopg.connect(servers.admin_url, autocommit=True) as admin:
                for db in (empty.name, full.name):
                    admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    return out


def _dead_tuples(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'harvest_jobs'"
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
        f"claim b=100, {label} finished",
        "ms",
        higher_is_better=False,
        comparisons=[Comparison(base, Target("ratio_max", 1.2, "≤ 1.2x (issue 16)"), "vs empty")],
        note=f"finished_at over {h.days} days; table {h.table_bytes / 2**30:.2f} GiB",
    )
    for row, runs in ((empty, h.claims_empty), (full, h.claims_full)):
        row.values = [round(statistics.median(r), 3) for r in runs]
        row.extra["claims_per_rep"] = len(runs[0]) if runs else 0
        row.extra["p95_ms"] = [round(percentile(r, 95), 3) for r in runs]
    full.extra["fill_seconds"] = round(h.fill_seconds, 1)
    full.extra["table_bytes"] = h.table_bytes
    after = Row(
        "scale",
        "claim b=100, right after retention",
        "ms",
        values=[round(statistics.median(h.claims_after_delete), 3)],
        higher_is_better=False,
        comparisons=[Comparison(base, None, "vs empty")],
        note=f"{h.dead_tuples:,} dead tuples, before vacuum",
        extra={"p95_ms": [round(percentile(h.claims_after_delete, 95), 3)]},
    )
    retention = Row(
        "scale",
        "retention of one day (DELETE)",
        "s",
        values=[round(h.retention_seconds, 2)],
        higher_is_better=False,
        target=Target("value_max", 1.0, "< 1 s (issue 16: partition drop)"),
        note=(
            f"{h.retention_rows:,} rows in {h.retention_statements:,} statements of "
            f"maintenance.prune; a partition drop is not built (issue 16 item 2)"
        ),
        extra={"rows": h.retention_rows},
    )
    dead = Row(
        "scale",
        "dead tuples after retention",
        "rows",
        values=[float(h.dead_tuples)],
        higher_is_better=False,
        target=Target("value_max", 0.0, "0 (no vacuum debt)"),
        note=(
            f"left by the DELETEs ({h.dead_tuples_total:,} on the table with the rolled-back"
            f" claims'); the VACUUM that pays them took {h.vacuum_seconds:.1f} s"
        ),
        extra={
            "vacuum_seconds": round(h.vacuum_seconds, 2),
            "dead_tuples_total": h.dead_tuples_total,
        },
    )
    return [empty, full, after, retention, dead]


def run(ctx: Ctx) -> list[Row]:
    ctx.plan(5 + 3)
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
