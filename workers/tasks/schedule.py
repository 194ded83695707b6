"""Tasks on the ``schedule`` queue: thin calls into harvest.dispatcher, harvest.schedules and
harvest.maintenance."""

from __future__ import annotations

from harvest import dispatcher, maintenance, schedules
from harvest.broker import DISPATCH_TASK, RESCUE_TASK
from workers import runtime
from workers.celery_app import app


@app.task(name=DISPATCH_TASK, acks_late=False, ignore_result=True)
def dispatch() -> int:
    return dispatcher.dispatch(runtime.harvest()).claimed


@app.task(name=RESCUE_TASK, acks_late=False, ignore_result=True)
def rescue() -> int:
    report = dispatcher.rescue(runtime.harvest())
    return report.requeued + report.failed + report.cancelled


@app.task(name=schedules.TASK, acks_late=False, ignore_result=True)
def fire_schedules() -> int:
    return schedules.fire_due(runtime.harvest()).jobs


@app.task(name=maintenance.TASK, acks_late=False, ignore_result=True)
def maintain() -> int:
    return maintenance.run(runtime.harvest()).total
