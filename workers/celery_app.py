"""The Celery app: harvest's configuration, queues, routes and beat schedule."""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery
from celery.signals import worker_process_init
from celery.worker.consumer.consumer import INVALID_TASK_ERROR, UNKNOWN_TASK_ERROR

from harvest import maintenance, schedules
from harvest.broker import DISPATCH_TASK, RESCUE_TASK, celery_config
from harvest.redact import redact_text
from harvest.settings import load_settings


class _DropMessageBodies(logging.Filter):
    """Celery logs the whole body and headers (``argsrepr``) of a message naming an unknown
    task, or of an invalid one. Those are somebody else's arguments, possibly with secrets in
    them: keep the first argument (what went wrong) and redact the rest."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg in (UNKNOWN_TASK_ERROR, INVALID_TASK_ERROR) and isinstance(
            record.args, tuple
        ):
            first = redact_text(str(record.args[0]))[:200]
            record.args = (first, *("<redacted>" for _ in record.args[1:]))
        return True


logging.getLogger("celery.worker.consumer.consumer").addFilter(_DropMessageBodies())

settings = load_settings()

app = Celery("workers")
app.conf.update(celery_config(settings))
app.conf.imports = ("workers.tasks.schedule", "workers.tasks.execution")
app.conf.beat_scheduler = "workers.beat:LeaderScheduler"
app.conf.beat_schedule = {
    "harvest-dispatch": {
        "task": DISPATCH_TASK,
        "schedule": settings.dispatch_interval,
        # A tick that waits longer than a few periods is useless: the next one does its work.
        "options": {"expires": max(5.0, settings.dispatch_interval * 5)},
    },
    "harvest-rescue": {
        "task": RESCUE_TASK,
        "schedule": settings.rescue_interval,
        "options": {"expires": max(10.0, settings.rescue_interval * 3)},
    },
    # Recurring schedules: exactly one job per fire time lives in Postgres, so a late or
    # doubled tick is harmless; an expired one is replaced by the next.
    "harvest-schedules": {
        "task": schedules.TASK,
        "schedule": settings.schedules_interval,
        "options": {"expires": max(5.0, settings.schedules_interval * 5)},
    },
    "harvest-maintenance": {
        "task": maintenance.TASK,
        "schedule": settings.maintenance_interval,
        "options": {"expires": max(30.0, settings.maintenance_interval)},
    },
}


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    """Each prefork child builds its own engine and clients (see workers.runtime)."""
    logging.getLogger("harvest").setLevel(logging.INFO)
