"""The no-op job behind the key pool gate (``HARVEST_IMPORTS=bench.jobs_pooled``): each run
leases a key of pool ``bench`` and releases it after."""

from __future__ import annotations

from harvest import Harvest, JobContext

NOOP_POOLED = "bench.noop_pooled"
POOL = "bench"

app = Harvest()


@app.job(NOOP_POOLED, max_attempts=3, timeout=60, pool=POOL)
def noop_pooled(ctx: JobContext) -> None:
    """Nothing, behind the key pool gate (fails without a key lease: the gate is on the way)."""
    if ctx.lease is None:
        raise RuntimeError("ran without a key lease")


NOOP_POOLED_ASYNC = "bench.noop_pooled_async"


@app.job(NOOP_POOLED_ASYNC, max_attempts=3, timeout=60, pool=POOL)
async def noop_pooled_async(ctx: JobContext) -> None:
    """Nothing, as an ``async def`` handler behind the key pool gate (fails without a lease)."""
    if ctx.lease is None:
        raise RuntimeError("ran without a key lease")
