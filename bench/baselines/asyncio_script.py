"""The script a user writes instead of a job system: one process, and per key an
httpx.AsyncClient carrying it, an asyncio.Semaphore (its concurrency) and an aiolimiter
AsyncLimiter (its rate); jobs take keys round-robin, a 429 sleeps its Retry-After and tries
again (five attempts in all). Nothing is durable.

One client per key, not one for all: a single httpx.AsyncClient with 1,024 connections spends
its time in httpcore's pool bookkeeping (measured here: about 1,000 calls, then the process at
100 % CPU with nothing in flight), which would measure httpcore rather than the approach.

``BENCH_KEYS='[{"secret": ..., "concurrency": 4, "rate": 120, "period": 60}]'
BENCH_LOOPBACK_URL=http://... BENCH_JOBS=1000 python -m bench.baselines.asyncio_script``
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import httpx
from aiolimiter import AsyncLimiter


async def main() -> None:
    keys = json.loads(os.environ["BENCH_KEYS"])
    url = os.environ["BENCH_LOOPBACK_URL"] + "/v1/call"
    jobs = int(os.environ["BENCH_JOBS"])
    async with contextlib.AsyncExitStack() as stack:
        slots = []
        for k in keys:
            limits = httpx.Limits(max_connections=k["concurrency"])
            headers = {"Authorization": f"Bearer {k['secret']}"}
            http = httpx.AsyncClient(headers=headers, limits=limits, timeout=60)
            await stack.enter_async_context(http)
            limiter = AsyncLimiter(k["rate"], k["period"])
            slots.append((http, asyncio.Semaphore(k["concurrency"]), limiter))

        async def run(i: int) -> bool:
            http, semaphore, limiter = slots[i % len(slots)]
            for attempt in range(1, 6):
                async with semaphore, limiter:
                    r = await http.post(url, json={"job": i, "attempt": attempt, "i": i})
                if r.status_code == 429:
                    await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                elif r.is_success:
                    return True
            return False

        done = await asyncio.gather(*(run(i) for i in range(jobs)), return_exceptions=True)
    print(json.dumps({"succeeded": sum(d is True for d in done), "jobs": jobs}), flush=True)


if __name__ == "__main__":
    print("bench-ready", flush=True)
    asyncio.run(main())
