"""What both plain-Celery baselines share: the configuration a plain Celery user would give
them (no harvest), with no app made at import."""

from __future__ import annotations

import sys
from typing import Any

from celery import Celery
from celery.signals import worker_ready

READY = "ready."  # what the bench waits for in a worker's log


def plain_celery(name: str, broker_url: str, queue: str) -> Celery:
    """A Celery app as a plain Celery user would configure it for these runs: JSON, late acks,
    no results, one default queue."""
    app = Celery(name, broker=broker_url)
    app.conf.update(
        task_acks_late=True,
        task_ignore_result=True,
        result_backend=None,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=queue,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    worker_ready.connect(_say_ready, weak=False, dispatch_uid="bench-plain-ready")
    return app


def _say_ready(**_: Any) -> None:
    """The bench runs these workers at Celery's default level (WARNING), as a plain Celery user
    does, where Celery logs no "ready." line: one on the worker's own stdout, once it consumes."""
    out = sys.__stdout__
    if out is not None:
        out.write(f"bench: worker {READY}\n")
        out.flush()
