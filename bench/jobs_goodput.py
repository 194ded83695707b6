"""The jobs of the goodput scenario (``HARVEST_IMPORTS=bench.jobs_goodput``): one call to the
loopback AI-API service with a key leased from pool ``bench``, written as the README shows,
as an ``async def`` handler and as its sync twin. The service's URL comes in
``BENCH_LOOPBACK_URL``."""

from __future__ import annotations

import os
from typing import Any

from harvest import Harvest, JobContext

CALL = "bench.goodput.call"  # async def
CALL_SYNC = "bench.goodput.call_sync"
CALL_TOKENS = "bench.goodput.call_tokens"  # async def, reserving max_tokens on the key
POOL = "bench"

app = Harvest()


def _url() -> str:
    return os.environ["BENCH_LOOPBACK_URL"] + "/v1/call"


@app.job(CALL, pool=POOL, max_attempts=5, timeout=60)
async def call(ctx: JobContext, i: int) -> None:
    async with ctx.aclient() as http:
        r = await http.post(_url(), json={"job": ctx.job_id, "attempt": ctx.attempt, "i": i})
    ctx.observe(r)  # the key follows the service's rate-limit headers
    if r.status_code == 429:
        ctx.rate_limited(float(r.headers.get("Retry-After", "1")))  # the key cools, job retries
    if r.status_code in (401, 403):
        ctx.key_rejected(f"HTTP {r.status_code}")
    r.raise_for_status()


def _max_tokens(payload: dict[str, Any]) -> int:
    """What a call may cost: the most tokens the request allows (as AI APIs count it)."""
    return int(payload["max_tokens"])


@app.job(CALL_TOKENS, pool=POOL, max_attempts=5, timeout=60, cost=_max_tokens)
async def call_tokens(ctx: JobContext, i: int, max_tokens: int) -> None:
    async with ctx.aclient() as http:
        r = await http.post(_url(), json={"job": ctx.job_id, "attempt": ctx.attempt, "i": i})
    ctx.observe(r)
    if r.status_code == 429:
        ctx.rate_limited(float(r.headers.get("Retry-After", "1")))
    if r.status_code in (401, 403):
        ctx.key_rejected(f"HTTP {r.status_code}")
    r.raise_for_status()
    ctx.used(tokens=r.json()["usage"]["total_tokens"])  # the rest of max_tokens is refunded


@app.job(CALL_SYNC, pool=POOL, max_attempts=5, timeout=60)
def call_sync(ctx: JobContext, i: int) -> None:
    with ctx.client() as http:
        r = http.post(_url(), json={"job": ctx.job_id, "attempt": ctx.attempt, "i": i})
    ctx.observe(r)
    if r.status_code == 429:
        ctx.rate_limited(float(r.headers.get("Retry-After", "1")))
    if r.status_code in (401, 403):
        ctx.key_rejected(f"HTTP {r.status_code}")
    r.raise_for_status()
