"""Plain Celery calling the loopback AI-API service on ``-P gevent -c 64``, as a user without
harvest would: the keys are taken round-robin by task number (nothing knows which key is
busy), a 429 is retried after its Retry-After with ``self.retry`` (as often as it takes),
other errors five times with backoff. Same Redis broker, ``acks_late``, no result backend.

``BENCH_BROKER_URL=redis://.../N BENCH_KEYS='["sk-...", ...]' BENCH_LOOPBACK_URL=http://...
celery -A bench.baselines.celery_gevent worker -P gevent -c 64 -Q bench_goodput``
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import httpx
from celery import Celery

from bench.baselines.plain import plain_celery

QUEUE = "bench_goodput"
TASK = "bench.goodput_call"


def make_app(broker_url: str) -> Celery:
    return plain_celery("bench_goodput", broker_url, QUEUE)


app = make_app(os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/15"))


@functools.cache
def _client() -> httpx.Client:
    """One pooled client per worker process, shared by its greenlets."""
    return httpx.Client(limits=httpx.Limits(max_connections=256), timeout=60)


@functools.cache
def _keys() -> list[str]:
    return list(json.loads(os.environ["BENCH_KEYS"]))


@app.task(
    name=TASK,
    bind=True,
    max_retries=None,  # a 429 is retried as often as it takes
    autoretry_for=(httpx.HTTPError,),
    retry_kwargs={"max_retries": 5},  # other errors five times
    retry_backoff=True,
)
def call(self: Any, i: int) -> None:
    keys = _keys()
    r = _client().post(
        os.environ["BENCH_LOOPBACK_URL"] + "/v1/call",
        json={"job": i, "attempt": self.request.retries + 1, "i": i},
        headers={"Authorization": f"Bearer {keys[i % len(keys)]}"},
    )
    if r.status_code == 429:
        raise self.retry(countdown=float(r.headers.get("Retry-After", "1")))
    r.raise_for_status()
