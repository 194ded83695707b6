"""Tasks on the ``schedule`` queue: thin calls into harvest.dispatcher, harvest.schedules and
harvest.maintenance.

While Postgres, Redis or the broker is away, a tick that needs it fails quietly: the outage is
logged once when it starts and once when it ends, with a count (harvest.outage), not
with a traceback per tick. Every tick is safe to skip: the next one does its work."""

from __future__ import annotations

import logging
from collections.abc import Callable

from harvest import dispatcher, maintenance, schedules
from harvest.broker import DISPATCH_TASK, RESCUE_TASK
from harvest.outage import BROKER, POSTGRES, REDIS, Outages, service_of
from harvest.worker import runtime
from harvest.worker.app import app, settings

log = logging.getLogger(__name__)
# Ticks are harvest's plumbing: out of Celery's event stream (Flower) unless asked for.
TICK = {"acks_late": False, "ignore_result": True, "send_events": settings.tick_events}
outages = Outages(log, "ticks")


@app.task(name=DISPATCH_TASK, **TICK)
def dispatch() -> int:
    def work() -> int:
        dispatcher.rescue_if_due(runtime.harvest())  # not only behind dispatch in the queue
        return dispatcher.dispatch(runtime.harvest()).claimed

    return tick(DISPATCH_TASK, work)


@app.task(name=RESCUE_TASK, **TICK)
def rescue() -> int:
    def work() -> int:
        report = dispatcher.rescue(runtime.harvest())
        return report.requeued + report.failed + report.cancelled

    return tick(RESCUE_TASK, work)


@app.task(
    name=schedules.TASK, acks_late=False, ignore_result=True, send_events=settings.tick_events
)
def fire_schedules() -> int:
    return tick(schedules.TASK, lambda: schedules.fire_due(runtime.harvest()).jobs)


@app.task(
    name=maintenance.TASK, acks_late=False, ignore_result=True, send_events=settings.tick_events
)
def maintain() -> int:
    return tick(maintenance.TASK, lambda: maintenance.run(runtime.harvest()).total)


def tick(name: str, work: Callable[[], int]) -> int:
    """Run one tick; a service's absence is counted (see harvest.outage), not raised."""
    try:
        done = work()
    except Exception as exc:
        service = service_of(exc)
        if service is None:
            raise
        outages.failed(service, exc, name)
        return 0
    outages.answered(POSTGRES)  # every tick reads Postgres
    if outages.away(REDIS) and _redis_answers():
        outages.answered(REDIS)
    if name == DISPATCH_TASK and done:
        outages.answered(BROKER)  # it published what it claimed
    return done


def _redis_answers() -> bool:
    try:
        return bool(runtime.harvest().redis.ping())
    except Exception:
        return False
