"""The harvest jobs the benchmark's workers run (``HARVEST_IMPORTS=bench.jobs``).

Only harvest's public API: a ``Harvest`` object at module level whose jobs the workers load.
The job behind the key pool gate lives in :mod:`bench.jobs_pooled`, imported only by the
workers of the gate scenario, so that the other scenarios run harvest with no pool declared.
"""

from __future__ import annotations

from harvest import Harvest, JobContext

NOOP = "bench.noop"

app = Harvest()


@app.job(NOOP, max_attempts=3, timeout=60)
def noop(ctx: JobContext) -> None:
    """Nothing: what is measured is the platform's cost per job."""


NOOP_ASYNC = "bench.noop_async"


@app.job(NOOP_ASYNC, max_attempts=3, timeout=60)
async def noop_async(ctx: JobContext) -> None:
    """Nothing, as an ``async def`` handler: many run at once on each process's event loop,
    and their fenced writes and key leases are grouped."""
