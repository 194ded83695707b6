"""Plain Celery, as its user would set it up for at-least-once no-op tasks: the same Redis
broker as harvest, ``acks_late``, no result backend, JSON, Celery's default prefetch.

``BENCH_BROKER_URL=redis://.../N celery -A bench.baselines.celery_app worker -Q bench_plain``
"""

from __future__ import annotations

import os

from celery import Celery

QUEUE = "bench_plain"
TASK = "bench.plain_noop"
PRIORITY_STEPS = (0, 3, 6, 9)  # kombu's Redis transport: one list per priority step
SEP = "\x06\x16"


def make_app(broker_url: str) -> Celery:
    app = Celery("bench_plain", broker=broker_url)
    app.conf.update(
        task_acks_late=True,
        task_ignore_result=True,
        result_backend=None,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=QUEUE,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )

    @app.task(name=TASK)
    def noop() -> None:
        """Nothing."""

    return app


def queue_keys() -> list[str]:
    """The Redis lists that hold the queue's waiting messages."""
    return [QUEUE if step == 0 else f"{QUEUE}{SEP}{step}" for step in PRIORITY_STEPS]


app = make_app(os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/15"))
