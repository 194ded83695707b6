"""PgQueuer's queue manager for the benchmark: one process, batches of ``BENCH_BATCH`` jobs,
on a psycopg async connection (PgQueuer's defaults otherwise).

``BENCH_PG_URL=postgresql://... python -m bench.baselines.pgqueuer_worker``
"""

from __future__ import annotations

import asyncio
import os
import signal

import psycopg
from pgqueuer import PgQueuer, PsycopgDriver
from pgqueuer.models import Job

ENTRYPOINT = "bench_noop"


async def main() -> None:
    url = os.environ.get("BENCH_PG_URL", "")
    batch = int(os.environ.get("BENCH_BATCH", "10"))
    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    pgq = PgQueuer(PsycopgDriver(conn))

    @pgq.entrypoint(ENTRYPOINT)
    async def noop(job: Job) -> None:
        """Nothing."""

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, pgq.shutdown.set)
    print("bench-ready", flush=True)
    try:
        await pgq.run(batch_size=batch)
    finally:
        await conn.close()


if __name__ == "__main__":
    asyncio.run(main())
