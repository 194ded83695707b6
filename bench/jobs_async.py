"""The async job of the memory scenario (``HARVEST_IMPORTS=bench.jobs_async``): it waits as a
network call would, so that a worker holds a thousand of them in flight at once."""

from __future__ import annotations

import asyncio

from harvest import Harvest, JobContext

WAIT = "bench.async_wait"

app = Harvest()


@app.job(WAIT, max_attempts=3, timeout=60)
async def async_wait(ctx: JobContext, seconds: float = 1.0) -> None:
    """Await ``seconds`` (no I/O of its own): what is measured is the worker's memory."""
    await asyncio.sleep(seconds)
