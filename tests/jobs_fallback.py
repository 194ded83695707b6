"""Jobs with fallback pools (HARVEST_IMPORTS=tests.jobs_fallback): kept apart from tests.jobs
so that the other tests' dispatch rounds do not look at these pools."""

from __future__ import annotations

from typing import Any

from harvest import Harvest, JobContext
from tests.jobs import FAST_RETRY

app = Harvest()

POOLS = ["fb-first", "fb-second"]


@app.job("fallback_call", pool=POOLS, max_attempts=3, retry=FAST_RETRY, timeout=30)
def fallback_call(ctx: JobContext, url: str | None = None, hold: float = 0.0) -> dict[str, Any]:
    """Calls the test API server (when given a url) with the key of whichever pool served;
    returns that pool and key."""
    assert ctx.lease is not None
    if url is not None:
        with ctx.client() as http:
            params = {"fence": ctx.lease.fence, "hold": hold, "job": ctx.job_id}
            http.get(url, params=params).raise_for_status()
    return {"pool": ctx.pool, "key_id": ctx.lease.key_id}


@app.job("async_fallback_call", pool=POOLS, max_attempts=3, retry=FAST_RETRY, timeout=30)
async def async_fallback_call(
    ctx: JobContext, url: str | None = None, hold: float = 0.0
) -> dict[str, Any]:
    """fallback_call's async twin (through ctx.aclient())."""
    assert ctx.lease is not None
    if url is not None:
        async with ctx.aclient() as http:
            params = {"fence": ctx.lease.fence, "hold": hold, "job": ctx.job_id}
            (await http.get(url, params=params)).raise_for_status()
    return {"pool": ctx.pool, "key_id": ctx.lease.key_id}


@app.job("async_first_only", pool=POOLS[0], max_attempts=3, retry=FAST_RETRY, timeout=30)
async def async_first_only(ctx: JobContext) -> dict[str, Any]:
    """A job of the first pool alone (no fallback): returns its key."""
    assert ctx.lease is not None
    return {"pool": ctx.pool, "key_id": ctx.lease.key_id}
