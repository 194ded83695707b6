"""Jobs that the test workers run (HARVEST_IMPORTS=tests.jobs)."""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

from harvest import Harvest, JobContext, PermanentError, RetryPolicy

app = Harvest()

FAST_RETRY = RetryPolicy(base=0.3, factor=2.0, max_delay=5.0, jitter=0.1)


def _effects_conn() -> psycopg.Connection[Any]:
    url = os.environ["HARVEST_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://")
    return psycopg.connect(url, autocommit=True)


@app.job("noop")
def noop(ctx: JobContext) -> None:
    return None


@app.job("echo")
def echo(ctx: JobContext, value: Any = None) -> dict[str, Any]:
    return {"value": value, "job_id": ctx.job_id, "attempt": ctx.attempt}


@app.job("always_fails", max_attempts=3, retry=FAST_RETRY)
def always_fails(ctx: JobContext, message: str = "boom") -> None:
    raise RuntimeError(f"{message} (attempt {ctx.attempt})")


@app.job("permanent_failure", max_attempts=5, retry=FAST_RETRY)
def permanent_failure(ctx: JobContext) -> None:
    raise PermanentError("this input can never work")


@app.job("sleepy", max_attempts=3, retry=FAST_RETRY, timeout=60)
def sleepy(ctx: JobContext, seconds: float = 1.0) -> dict[str, int]:
    time.sleep(seconds)
    return {"attempt": ctx.attempt}


@app.job("effect", max_attempts=5, retry=FAST_RETRY)
def effect(ctx: JobContext, seconds: float = 0.0) -> None:
    """Records one row per execution (not unique): the test counts executions per job."""
    if seconds:
        time.sleep(seconds)
    with _effects_conn() as conn:
        conn.execute(
            "INSERT INTO test_effects (job_id, attempt, pid) VALUES (%s, %s, %s)",
            (ctx.job_id, ctx.attempt, os.getpid()),
        )


_kept: dict[int, Any] = {}


@app.job("short_effect", max_attempts=5, retry=FAST_RETRY)
def short_effect(ctx: JobContext) -> None:
    """Counts its executions in Redis (``test:short_effects``, by job id) on a client this
    process keeps: a fraction of a millisecond, short enough for a prefork process to start
    and end such jobs together (``effect`` commits a row, a millisecond or more)."""
    import redis

    client = _kept.get(os.getpid())
    if client is None:
        client = _kept[os.getpid()] = redis.Redis.from_url(os.environ["HARVEST_REDIS_URL"])
    client.hincrby("test:short_effects", str(ctx.job_id), 1)


@app.job("short_keyed_effect", pool="short-pool", max_attempts=5, retry=FAST_RETRY)
def short_keyed_effect(ctx: JobContext) -> None:
    """``short_effect`` with a key of ``short-pool``: also counts, in ``test:short_overlaps``,
    the calls that found another call on their key (each key there allows one at once)."""
    import redis

    assert ctx.lease is not None
    client = _kept.get(os.getpid())
    if client is None:
        client = _kept[os.getpid()] = redis.Redis.from_url(os.environ["HARVEST_REDIS_URL"])
    on_key = f"test:short_on_key:{ctx.lease.key_id}"
    if client.incr(on_key) > 1:
        client.incr("test:short_overlaps")
    client.hincrby("test:short_effects", str(ctx.job_id), 1)
    client.decr(on_key)


@app.job("timed_out", max_attempts=2, retry=FAST_RETRY, timeout=0.5)
def timed_out(ctx: JobContext) -> None:
    time.sleep(10)


@app.job("call_api", pool="test-pool", max_attempts=5, retry=FAST_RETRY, timeout=30)
def call_api(ctx: JobContext, url: str, hold: float = 0.0) -> dict[str, Any]:
    """Calls the test API server with the leased key (a pooled client per key); the server
    logs (key digest, fence, start, end)."""
    assert ctx.lease is not None
    with ctx.client() as http:
        params = {"fence": ctx.lease.fence, "hold": hold, "job": ctx.job_id}
        response = http.get(url, params={**params, "granted": ctx.lease.granted_at})
    if response.status_code == 429:
        ctx.rate_limited(float(response.headers.get("Retry-After", "1")))
    if response.status_code in (401, 403):
        ctx.key_rejected(f"HTTP {response.status_code}")
    response.raise_for_status()
    with _effects_conn() as conn:
        conn.execute(
            "INSERT INTO test_effects (job_id, attempt, pid) VALUES (%s, %s, %s)",
            (ctx.job_id, ctx.attempt, os.getpid()),
        )
    return {"key_id": ctx.lease.key_id, "body": response.text}


# --- scheduling and flow control ------------------------------------------------------------


@app.job("tick")
def tick(ctx: JobContext, schedule: str = "") -> dict[str, Any]:
    """What a recurring schedule enqueues in the tests."""
    return {"schedule": schedule, "job_id": ctx.job_id}


@app.job("limited", max_depth=5)
def limited(ctx: JobContext, value: Any = None) -> None:
    """A job with its own max_depth of pending jobs."""


@app.job("batch_done", max_attempts=3, retry=FAST_RETRY)
def batch_done(
    ctx: JobContext, batch_id: int, succeeded: int, failed: int, cancelled: int, tag: str = ""
) -> dict[str, Any]:
    """A batch callback: returns what it was told (the test reads the job's result)."""
    return {
        "batch_id": batch_id,
        "succeeded": succeeded,
        "failed": failed,
        "cancelled": cancelled,
        "tag": tag,
    }


@app.job("cooperative", max_attempts=3, retry=FAST_RETRY, timeout=120)
def cooperative(ctx: JobContext, seconds: float = 60.0) -> dict[str, Any]:
    """Records that it started, then works until done or until ``ctx.cancelled``."""
    with _effects_conn() as conn:
        conn.execute(
            "INSERT INTO test_effects (job_id, attempt, pid) VALUES (%s, %s, %s)",
            (ctx.job_id, ctx.attempt, os.getpid()),
        )
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ctx.cancelled:
            return {"stopped": "cancelled"}
        time.sleep(0.05)
    return {"stopped": "done"}


@app.job("fails_slowly", max_attempts=5, retry=FAST_RETRY, timeout=60)
def fails_slowly(ctx: JobContext, seconds: float = 1.0) -> None:
    """Records that it started, works for ``seconds`` without looking at ``ctx.cancelled``,
    then fails (a retryable error)."""
    with _effects_conn() as conn:
        conn.execute(
            "INSERT INTO test_effects (job_id, attempt, pid) VALUES (%s, %s, %s)",
            (ctx.job_id, ctx.attempt, os.getpid()),
        )
    time.sleep(seconds)
    raise RuntimeError("failed after the cancel request")


# --- async handlers (run on each worker process's event loop) ---------------------------------

_async_pools: dict[int, Any] = {}


async def _record(ctx: JobContext) -> None:
    """One effect row, through a small connection pool of this process's event loop."""
    import asyncio

    from psycopg_pool import AsyncConnectionPool

    loop = id(asyncio.get_running_loop())
    pool = _async_pools.get(loop)
    if pool is None:
        url = os.environ["HARVEST_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://")
        pool = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=4,
            # Nothing prepared: the tests run these workers behind PgBouncer too.
            kwargs={"autocommit": True, "prepare_threshold": None},
            open=False,
        )
        await pool.open()
        _async_pools[loop] = pool
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO test_effects (job_id, attempt, pid) VALUES (%s, %s, %s)",
            (ctx.job_id, ctx.attempt, os.getpid()),
        )


@app.job("async_effect", max_attempts=5, retry=FAST_RETRY, timeout=60)
async def async_effect(ctx: JobContext, seconds: float = 0.0) -> dict[str, Any]:
    """Waits ``seconds`` (as a network call would), then records one effect row."""
    import asyncio

    await asyncio.sleep(seconds)
    await _record(ctx)
    return {"attempt": ctx.attempt}


@app.job("async_timed_out", max_attempts=2, retry=FAST_RETRY, timeout=0.5)
async def async_timed_out(ctx: JobContext) -> None:
    import asyncio

    await _record(ctx)
    await asyncio.sleep(30)


@app.job("async_stubborn", max_attempts=1, timeout=0.3)
async def async_stubborn(ctx: JobContext, keeps_on: float = 5.5) -> None:
    """Ignores its time limit: swallows the CancelledError, goes on for ``keeps_on`` seconds
    (as a handler finishing a call in a ``finally`` would), then records its effect."""
    import asyncio

    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        await asyncio.sleep(keeps_on)
    await _record(ctx)


@app.job("async_cancellable", max_attempts=3, retry=FAST_RETRY, timeout=120)
async def async_cancellable(ctx: JobContext, seconds: float = 60.0) -> dict[str, Any]:
    """Records that it started, then waits (never looking at ctx.cancelled): cancelling the
    job must stop it (CancelledError inside the await)."""
    import asyncio

    await _record(ctx)
    await asyncio.sleep(seconds)
    return {"stopped": "done"}


@app.job("async_call_api", pool="test-pool", max_attempts=5, retry=FAST_RETRY, timeout=30)
async def async_call_api(ctx: JobContext, url: str, hold: float = 0.0) -> dict[str, Any]:
    """call_api's async twin: the leased key through ctx.aclient()."""
    assert ctx.lease is not None
    async with ctx.aclient() as http:
        params = {"fence": ctx.lease.fence, "hold": hold, "job": ctx.job_id}
        response = await http.get(url, params=params)
    if response.status_code == 429:
        ctx.rate_limited(float(response.headers.get("Retry-After", "1")))
    if response.status_code in (401, 403):
        ctx.key_rejected(f"HTTP {response.status_code}")
    response.raise_for_status()
    await _record(ctx)
    return {"key_id": ctx.lease.key_id}


@app.job("async_token_call", pool="token-pool", cost=600, max_attempts=5, retry=FAST_RETRY)
async def async_token_call(
    ctx: JobContext, url: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One call that reserves 600 tokens (the most the service draws) and reports what the
    service says it used: the rest is refunded to the key's token budget. ``extra`` goes in
    the request body (the service's ``latency`` and ``tokens`` overrides)."""
    body = {"job": ctx.job_id, "attempt": ctx.attempt, **(extra or {})}
    async with ctx.aclient() as http:
        response = await http.post(url, json=body)
    if response.status_code == 429:
        ctx.rate_limited(float(response.headers.get("Retry-After", "1")))
    response.raise_for_status()
    ctx.used(tokens=response.json()["usage"]["total_tokens"])
    return {"key_id": ctx.lease.key_id if ctx.lease else None}
