"""Jobs that the chaos suite's workers run (HARVEST_IMPORTS=tests.chaos.jobs).

The workload job ``chaos.work`` does what a real harvest job does: it waits a little (the
"work"), calls an API through a key of the pool (the test's HTTP server logs key, fence, start
and end: the overlap oracle), and records its effect. The effect is made idempotent by job id
the way the README tells users to, and fenced by the attempt harvest handed out:

1. every execution is logged in ``chaos_executions`` (at-least-once: executions >= jobs);
2. in one statement (the function ``chaos_effect``, one transaction): lock the job's row
   ``FOR SHARE`` only while it is still ``running`` at this execution's attempt (a stale
   execution, whose lease was taken back, finds nothing and writes nothing: outcome
   ``stale``); an effect already recorded by an earlier attempt is left alone (outcome
   ``already``: idempotent by job id); otherwise the effect is inserted (``applied``).
3. An insert that still hits the unique key means two executions of the *same attempt* wrote
   at once, which harvest must never allow: it is counted in ``chaos_conflicts`` (a duplicate
   effect) instead of raising.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
from typing import Any

import psycopg

from harvest import Harvest, JobContext, PermanentError, RetryPolicy

app = Harvest()

POOL = "chaos"
SOLO = "solo"  # one key, max_concurrency 1 (F7)
RETRY = RetryPolicy(base=0.2, factor=2.0, max_delay=2.0, jitter=0.2)
HOST = os.environ.get("CHAOS_HOST") or socket.gethostname()

SCHEMA = """
CREATE TABLE IF NOT EXISTS chaos_executions (
    id bigserial PRIMARY KEY, job_id bigint NOT NULL, attempt int NOT NULL, pid int NOT NULL,
    host text NOT NULL, started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at timestamptz, outcome text);
CREATE INDEX IF NOT EXISTS chaos_executions_job ON chaos_executions (job_id);
CREATE TABLE IF NOT EXISTS chaos_effects (
    job_id bigint PRIMARY KEY, attempt int NOT NULL, pid int NOT NULL, host text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE IF NOT EXISTS chaos_conflicts (
    job_id bigint NOT NULL, attempt int NOT NULL, pid int NOT NULL, host text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE OR REPLACE FUNCTION chaos_effect(
    p_exec bigint, p_job bigint, p_attempt int, p_pid int, p_host text) RETURNS text AS $$
DECLARE
    result text;
BEGIN
    -- The fence: the job is still running at this attempt, and stays so until we commit.
    PERFORM 1 FROM harvest_jobs
        WHERE id = p_job AND status = 'running' AND attempts = p_attempt FOR SHARE;
    IF NOT FOUND THEN
        result := 'stale';
    ELSIF EXISTS (SELECT 1 FROM chaos_effects WHERE job_id = p_job) THEN
        result := 'already';  -- an earlier attempt's effect stands: idempotent by job id
    ELSE
        INSERT INTO chaos_effects (job_id, attempt, pid, host)
            VALUES (p_job, p_attempt, p_pid, p_host) ON CONFLICT (job_id) DO NOTHING;
        IF FOUND THEN
            result := 'applied';
        ELSE
            INSERT INTO chaos_conflicts (job_id, attempt, pid, host)
                VALUES (p_job, p_attempt, p_pid, p_host);
            result := 'conflict';  -- two executions of one attempt: a duplicate effect
        END IF;
    END IF;
    UPDATE chaos_executions SET ended_at = clock_timestamp(), outcome = result
        WHERE id = p_exec;
    RETURN result;
END
$$ LANGUAGE plpgsql;
"""
TABLES = ("chaos_executions", "chaos_effects", "chaos_conflicts")

_conn: dict[int, psycopg.Connection[Any]] = {}


def _db() -> psycopg.Connection[Any]:
    """This process's own connection (not harvest's: application_name ``chaos``)."""
    conn = _conn.get(os.getpid())
    if conn is None or conn.closed or conn.broken:
        _conn.clear()
        url = os.environ["HARVEST_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://")
        pooled = os.environ.get("HARVEST_DATABASE_POOLER") == "transaction"  # F13: PgBouncer
        conn = psycopg.connect(
            url,
            autocommit=True,
            connect_timeout=5,
            application_name="chaos",
            prepare_threshold=None if pooled else 5,
        )
        _conn[os.getpid()] = conn
    return conn


def _sql(query: str, params: tuple[Any, ...]) -> Any:
    """One autocommitted statement; its first row (None when it returns none)."""
    try:
        cursor = _db().execute(query, params)
        return cursor.fetchone() if cursor.description else None
    except psycopg.OperationalError:
        _conn.clear()  # reconnect next time; this execution fails and harvest retries it
        raise


def _begin(ctx: JobContext) -> int:
    """Log this execution; returns its row id."""
    row = _sql(
        "INSERT INTO chaos_executions (job_id, attempt, pid, host) VALUES (%s, %s, %s, %s) "
        "RETURNING id",
        (ctx.job_id, ctx.attempt, os.getpid(), HOST),
    )
    return int(row[0])


def _effect(ctx: JobContext, execution: int) -> str:
    """The fenced, idempotent effect (one statement: see the module docstring)."""
    row = _sql(
        "SELECT chaos_effect(%s, %s, %s, %s, %s)",
        (execution, ctx.job_id, ctx.attempt, os.getpid(), HOST),
    )
    return str(row[0])


def _call(ctx: JobContext, execution: int, url: str, hold: float) -> None:
    """Call the API with the leased key (ctx.client() refuses when the lease was lost); an
    error ends this execution's log row with its name before it propagates."""
    assert ctx.lease is not None
    try:
        with ctx.client() as http:
            response = http.get(
                url, params={"fence": ctx.lease.fence, "hold": hold, "job": ctx.job_id}
            )
        response.raise_for_status()
    except Exception as exc:
        with contextlib.suppress(psycopg.Error):
            _sql(
                "UPDATE chaos_executions SET ended_at = clock_timestamp(), outcome = %s "
                "WHERE id = %s",
                (f"error {type(exc).__name__}: {exc}"[:300], execution),
            )
        raise


@app.job("chaos.work", pool=POOL, max_attempts=25, retry=RETRY, timeout=25)
def work(
    ctx: JobContext,
    url: str,
    low_ms: int = 20,
    high_ms: int = 200,
    hold: float = 0.01,
    seconds: float | None = None,
) -> dict[str, Any]:
    """Sleep ``seconds`` (else low..high ms), call the API with the leased key, record the
    effect (see the module docstring)."""
    execution = _begin(ctx)
    time.sleep(seconds if seconds is not None else random.uniform(low_ms, high_ms) / 1000)
    _call(ctx, execution, url, hold)
    outcome = _effect(ctx, execution)
    return {"outcome": outcome, "attempt": ctx.attempt}


@app.job("chaos.plain", max_attempts=25, retry=RETRY, timeout=25)
def plain(ctx: JobContext, low_ms: int = 20, high_ms: int = 200) -> dict[str, Any]:
    """The workload without a key pool (cases about Postgres and the schedule side)."""
    execution = _begin(ctx)
    time.sleep(random.uniform(low_ms, high_ms) / 1000)
    outcome = _effect(ctx, execution)
    return {"outcome": outcome, "attempt": ctx.attempt}


@app.job("chaos.tick")
def tick(ctx: JobContext, schedule: str = "") -> dict[str, Any]:
    """What the recurring schedule of F8 enqueues."""
    return {"schedule": schedule, "job_id": ctx.job_id}


@app.job("chaos.typed", max_attempts=5, retry=RETRY)
def typed(ctx: JobContext, n: int = 0) -> int:
    """Fits the door (any JSON for ``n``); ``n + 1`` raises TypeError when ``n`` is not a
    number: a payload that fails at execution (permanent, not retried)."""
    return n + 1


@app.job("chaos.bad_input", max_attempts=5, retry=RETRY)
def bad_input(ctx: JobContext, url: str = "") -> None:
    """Rejects its input the way a handler should: PermanentError (failed at once)."""
    if not url.startswith("http"):
        raise PermanentError(f"not a URL: {url[:40]!r}")


@app.job("chaos.leaky", pool=POOL, max_attempts=2, retry=RETRY)
def leaky(ctx: JobContext) -> None:
    """A careless handler: its error message and traceback contain the leased key."""
    raise RuntimeError(f"upstream refused key {ctx.key}")


@app.job("chaos.solo", pool=SOLO, max_attempts=5, retry=RETRY, timeout=25)
def solo(ctx: JobContext, url: str, seconds: float = 4.0, hold: float = 3.0) -> dict[str, Any]:
    """F7: works ``seconds``, then holds the only key of pool ``solo`` at the API for ``hold``."""
    execution = _begin(ctx)
    time.sleep(seconds)
    _call(ctx, execution, url, hold)
    return {"outcome": _effect(ctx, execution), "attempt": ctx.attempt}


# --- the async workload (F12) ------------------------------------------------------------------

WIDE = "chaos-wide"  # F12's pool: many keys of many leases each, hundreds of calls in flight
_pools: dict[int, Any] = {}


async def _asql(query: str, params: tuple[Any, ...]) -> Any:
    """``_sql`` on this process's event loop (a small pool of its own connections)."""
    import asyncio

    from psycopg_pool import AsyncConnectionPool

    loop = id(asyncio.get_running_loop())
    pool = _pools.get(loop)
    if pool is None:
        url = os.environ["HARVEST_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://")
        pool = AsyncConnectionPool(
            url, min_size=1, max_size=8, open=False,
            kwargs={"autocommit": True, "application_name": "chaos", "connect_timeout": 5},
        )  # fmt: skip
        await pool.open()
        _pools[loop] = pool
    async with pool.connection() as conn:
        cursor = await conn.execute(query, params)
        return await cursor.fetchone() if cursor.description else None


@app.job("chaos.awork", pool=WIDE, max_attempts=25, retry=RETRY, timeout=25)
async def awork(
    ctx: JobContext, url: str, low_ms: int = 200, high_ms: int = 1000, hold: float = 0.01
) -> dict[str, Any]:
    """``chaos.work`` as an ``async def`` handler: wait, call the API with the leased key
    through ``ctx.aclient()``, record the fenced, idempotent effect."""
    import asyncio

    row = await _asql(
        "INSERT INTO chaos_executions (job_id, attempt, pid, host) VALUES (%s, %s, %s, %s) "
        "RETURNING id",
        (ctx.job_id, ctx.attempt, os.getpid(), HOST),
    )
    execution = int(row[0])
    await asyncio.sleep(random.uniform(low_ms, high_ms) / 1000)
    assert ctx.lease is not None
    try:
        async with ctx.aclient() as http:
            params = {"fence": ctx.lease.fence, "hold": hold, "job": ctx.job_id}
            response = await http.get(url, params=params)
        response.raise_for_status()
    except Exception as exc:
        with contextlib.suppress(psycopg.Error):
            await _asql(
                "UPDATE chaos_executions SET ended_at = clock_timestamp(), outcome = %s "
                "WHERE id = %s",
                (f"error {type(exc).__name__}: {exc}"[:300], execution),
            )
        raise
    found = await _asql(
        "SELECT chaos_effect(%s, %s, %s, %s, %s)",
        (execution, ctx.job_id, ctx.attempt, os.getpid(), HOST),
    )
    return {"outcome": str(found[0]), "attempt": ctx.attempt}
