"""Scenario 8, key pool: lease + release cycles per second from two processes (``KeyPool.lease``
then ``KeyPool.release``, two Lua scripts per cycle), against the bare EVALSHA rate (a script
that returns 1, called twice per cycle) from two processes on the same Redis."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import redis

from bench.core import Comparison, Row
from bench.env import Ctx

POOL = "bench"
KEYS = 8
PROCESSES = 2


def pool_cycler(ready: Callable[[], None], url: str, seconds: float) -> tuple[int, float]:
    from harvest.coordination import Busy, KeyPool

    client = redis.Redis.from_url(url, socket_timeout=10)
    pool = KeyPool(client, POOL)
    holder = f"bench-{os.getpid()}"
    lease = pool.lease(holder, 30.0)  # loads the scripts before the clock starts
    if not isinstance(lease, Busy):
        pool.release(lease)
    ready()
    cycles = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        lease = pool.lease(holder, 30.0)
        if isinstance(lease, Busy):
            raise RuntimeError(f"pool busy with {KEYS} keys of 1000 leases each: {lease}")
        pool.release(lease)
        cycles += 1
    elapsed = time.perf_counter() - started
    client.close()
    return cycles, elapsed


def bare_cycler(ready: Callable[[], None], url: str, seconds: float) -> tuple[int, float]:
    client = redis.Redis.from_url(url, socket_timeout=10)
    script = client.register_script("return 1")
    script()
    ready()
    cycles = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        script()
        script()
        cycles += 1
    elapsed = time.perf_counter() - started
    client.close()
    return cycles, elapsed


def run(ctx: Ctx) -> list[Row]:
    from harvest.coordination import KeyPool, KeySpec

    quick, reps = ctx.cfg.quick, ctx.cfg.reps
    seconds = 1.0 if quick else 4.0
    client = ctx.redis()
    KeyPool(client, POOL).sync([KeySpec(key_id=i, max_concurrency=1000) for i in range(KEYS)])
    pool_row = Row(
        "keypool",
        "lease+release",
        "cycles/s",
        comparisons=[Comparison("bare EVALSHA x2", None, "vs bare")],
        note=f"{KEYS} keys, no rate limit, {PROCESSES} processes",
    )
    bare_row = Row(
        "keypool", "bare EVALSHA x2", "cycles/s", note="two calls of 'return 1' per cycle"
    )
    ctx.record(pool_row, bare_row)
    ctx.plan(1 + reps)
    for rep in range(reps + 1):
        ctx.step("keypool: warm-up" if rep == 0 else f"keypool: rep {rep}/{reps}")
        length = seconds / 2 if rep == 0 else seconds
        for target, row in ((pool_cycler, pool_row), (bare_cycler, bare_row)):
            results = ctx.parallel(target, [(ctx.redis_url, length)] * PROCESSES, timeout=120)
            rate = sum(c for c, _ in results) / max(e for _, e in results)
            if rep:
                row.values.append(rate)
        ctx.step("keypool", 1)
    return [pool_row, bare_row]
