"""procrastinate's worker for the benchmark: one process, ``BENCH_CONCURRENCY`` async jobs at
once, LISTEN/NOTIFY on (procrastinate's defaults otherwise).

``BENCH_PG_URL=postgresql://... python -m bench.baselines.procrastinate_worker``
"""

from __future__ import annotations

import asyncio
import os

import procrastinate

QUEUE = "bench"
TASK = "bench.noop"


def make_app(conninfo: str) -> procrastinate.App:
    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=conninfo, min_size=1, max_size=4)
    )

    @app.task(name=TASK, queue=QUEUE)
    async def noop() -> None:
        """Nothing."""

    return app


async def main() -> None:
    app = make_app(os.environ.get("BENCH_PG_URL", ""))
    concurrency = int(os.environ.get("BENCH_CONCURRENCY", "10"))
    async with app.open_async():
        print("bench-ready", flush=True)
        await app.run_worker_async(queues=[QUEUE], concurrency=concurrency, wait=True)


if __name__ == "__main__":
    asyncio.run(main())
