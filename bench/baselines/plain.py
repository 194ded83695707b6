"""What both plain-Celery baselines share: the configuration a plain Celery user would give
them (no harvest), with no app made at import."""

from __future__ import annotations

from celery import Celery


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
    return app
