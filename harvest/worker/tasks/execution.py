"""The task on the ``execution`` queue: a thin call into harvest.execution."""

from __future__ import annotations

from typing import Any

from harvest.broker import EXECUTE_TASK
from harvest.worker import runtime
from harvest.worker.app import app, settings


@app.task(
    name=EXECUTE_TASK,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
    send_events=settings.tick_events,  # each job attempt is its own task in the events
)
def execute(jobs: Any) -> dict[str, int]:
    """Hold a message's jobs and run them: sync ones here, to the end; async ones on this
    process's event loop, where they run on after this returns."""
    return runtime.executor().execute(jobs, wait=False)
