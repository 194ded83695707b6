"""Jobs that the web tests' workers run (HARVEST_IMPORTS=tests.web.jobs)."""

from __future__ import annotations

import os
import time
from typing import Any

import redis

from harvest import Harvest, JobContext, RetryPolicy

app = Harvest()

FLAG = "harvest:test:web:flaky-may-succeed"


@app.job("web_flaky", max_attempts=1)
def flaky(ctx: JobContext, note: str = "") -> dict[str, Any]:
    """Fails (dead at once: one attempt) until the Redis key FLAG exists, then succeeds."""
    client = redis.Redis.from_url(os.environ["HARVEST_REDIS_URL"])
    try:
        allowed = client.exists(FLAG) == 1
    finally:
        client.close()
    if not allowed:
        raise RuntimeError(f"upstream refused {note!r}: the flag {FLAG} is not set yet")
    return {"note": note, "attempt": ctx.attempt}


@app.job("web_three_tries", max_attempts=3)
def three_tries(ctx: JobContext) -> None:
    raise RuntimeError(f"try {ctx.attempt} failed")


@app.job("web_retry_later", max_attempts=3, retry=RetryPolicy(base=600, max_delay=600, jitter=0))
def retry_later(ctx: JobContext) -> None:
    """Fails; its next attempt is 10 minutes away (a job to see under "retrying")."""
    raise RuntimeError(f"upstream answered 503 on attempt {ctx.attempt}")


@app.job("web_waits", timeout=60)
def waits(ctx: JobContext, seconds: float = 5.0) -> None:
    """Runs until ``seconds`` pass or it is cancelled (a job to see in Processes)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not ctx.cancelled:
        time.sleep(0.1)


@app.job("web_noop")
def noop(ctx: JobContext, n: int = 0) -> dict[str, int]:
    return {"n": n}


@app.job("web_bulk", queue="bulk")
def bulk(ctx: JobContext, n: int = 0) -> None:
    return None


@app.job("web_batch_done")
def batch_done(ctx: JobContext, batch_id: int, succeeded: int, failed: int, cancelled: int) -> None:
    return None
