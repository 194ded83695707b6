"""The jobs of the goodput scenario (``HARVEST_IMPORTS=bench.jobs_goodput``): one call to the
loopback AI-API service with a key leased from pool ``bench``, written as the README shows,
as an ``async def`` handler and as a sync one, each also in a form that reserves ``max_tokens``
on keys with a token budget (the ``token-bound`` case). The service's URL comes in
``BENCH_LOOPBACK_URL``."""

from __future__ import annotations

import os
from typing import Any

from harvest import Harvest, JobContext

CALL = "bench.goodput.call"  # async def
CALL_SYNC = "bench.goodput.call_sync"
CALL_TOKENS = "bench.goodput.call_tokens"  # async def, reserving max_tokens on the key
CALL_TOKENS_SYNC = "bench.goodput.call_tokens_sync"
POOL = "bench"

app = Harvest()


def _url() -> str:
    return os.environ["BENCH_LOOPBACK_URL"] + "/v1/call"


def _answered(ctx: JobContext, r: Any, *, tokens: bool = False) -> None:
    """What every handler here does with the service's answer: the key follows its rate-limit
    headers; a 429 cools the key and retries the job; a 401 or 403 takes the key out; any
    other error fails the attempt; with ``tokens``, what the call used is reported (the rest
    of ``max_tokens`` is refunded)."""
    ctx.observe(r)
    if r.status_code == 429:
        ctx.rate_limited(float(r.headers.get("Retry-After", "1")))
    if r.status_code in (401, 403):
        ctx.key_rejected(f"HTTP {r.status_code}")
    r.raise_for_status()
    if tokens:
        ctx.used(tokens=r.json()["usage"]["total_tokens"])


def _body(ctx: JobContext, i: int) -> dict[str, int]:
    return {"job": ctx.job_id, "attempt": ctx.attempt, "i": i}


@app.job(CALL, pool=POOL, max_attempts=5, timeout=60)
async def call(ctx: JobContext, i: int) -> None:
    async with ctx.aclient() as http:
        r = await http.post(_url(), json=_body(ctx, i))
    _answered(ctx, r)


@app.job(CALL_SYNC, pool=POOL, max_attempts=5, timeout=60)
def call_sync(ctx: JobContext, i: int) -> None:
    with ctx.client() as http:
        r = http.post(_url(), json=_body(ctx, i))
    _answered(ctx, r)


def _max_tokens(payload: dict[str, Any]) -> int:
    """What a call may cost: the most tokens the request allows (as AI APIs count it)."""
    return int(payload["max_tokens"])


@app.job(CALL_TOKENS, pool=POOL, max_attempts=5, timeout=60, cost=_max_tokens)
async def call_tokens(ctx: JobContext, i: int, max_tokens: int) -> None:
    async with ctx.aclient() as http:
        r = await http.post(_url(), json=_body(ctx, i))
    _answered(ctx, r, tokens=True)


@app.job(CALL_TOKENS_SYNC, pool=POOL, max_attempts=5, timeout=60, cost=_max_tokens)
def call_tokens_sync(ctx: JobContext, i: int, max_tokens: int) -> None:
    with ctx.client() as http:
        r = http.post(_url(), json=_body(ctx, i))
    _answered(ctx, r, tokens=True)
