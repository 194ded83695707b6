"""Jobs that the web tests' workers run (HARVEST_IMPORTS=tests.web.jobs)."""

from __future__ import annotations

import os
from typing import Any

import redis

from harvest import Harvest, JobContext

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


@app.job("web_noop")
def noop(ctx: JobContext, n: int = 0) -> dict[str, int]:
    return {"n": n}


@app.job("web_bulk", queue="bulk")
def bulk(ctx: JobContext, n: int = 0) -> None:
    return None


@app.job("web_batch_done")
def batch_done(ctx: JobContext, batch_id: int, succeeded: int, failed: int, cancelled: int) -> None:
    return None
