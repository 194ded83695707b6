"""The task on the ``execution`` queue: a thin call into harvest.runner."""

from __future__ import annotations

from typing import Any

from harvest.broker import EXECUTE_TASK
from workers import runtime
from workers.celery_app import app


@app.task(name=EXECUTE_TASK, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def execute(jobs: Any) -> dict[str, int]:
    return runtime.runner().execute(jobs)
