"""Plain Celery, as its user would set it up for at-least-once no-op tasks: the same Redis
broker as harvest, ``acks_late``, no result backend, JSON, Celery's default prefetch.

``BENCH_BROKER_URL=redis://.../N celery -A bench.baselines.celery_app worker -Q bench_plain``
"""

from __future__ import annotations

import os

from celery import Celery

from bench.baselines.plain import plain_celery

QUEUE = "bench_plain"
TASK = "bench.plain_noop"
PRIORITY_STEPS = (0, 3, 6, 9)  # kombu's Redis transport: one list per priority step
SEP = "\x06\x16"


def make_app(broker_url: str) -> Celery:
    app = plain_celery("bench_plain", broker_url, QUEUE)

    @app.task(name=TASK)
    def noop() -> None:
        """Nothing."""

    return app


def queue_keys(queue: str = QUEUE) -> list[str]:
    """The Redis lists that hold the queue's waiting messages."""
    return [queue if step == 0 else f"{queue}{SEP}{step}" for step in PRIORITY_STEPS]


app = make_app(os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/15"))
