"""Attach harvest to a Celery app you already have.

:func:`install` adds harvest's queues (``schedule``, ``execution``), routes, tasks and beat
entries to your app and replaces nothing of yours: every other configuration key is left as
it was. What cannot be merged safely is refused with a ConfigurationError naming it (your app
does not accept JSON, its broker is not the one harvest publishes to, a queue, route or beat
entry of yours already uses one of harvest's names for something else).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from celery import Celery
from kombu import Connection, Exchange, Queue  # type: ignore[attr-defined]

from harvest import maintenance, schedules
from harvest.broker import DISPATCH_TASK, RESCUE_TASK, celery_config
from harvest.errors import ConfigurationError
from harvest.redact import redact_url
from harvest.settings import Settings, load_settings
from harvest.worker.events import FollowTaskEvents


def install(celery_app: Celery, *, settings: Settings | None = None) -> Celery:
    """Add harvest's queues, routes, tasks and beat entries to ``celery_app``; returns it.

    Start your workers with ``-Q schedule`` (dispatch and rescue) and ``-Q execution`` (the
    jobs) as for harvest's own app, and your beat as usual (``-S
    harvest.worker.beat:LeaderScheduler`` adds leader election for two beats).

    :param settings: harvest's settings (default: the ``HARVEST_*`` environment).
    :raises ConfigurationError: what cannot be merged safely, named.
    """
    settings = settings or load_settings()
    conf = celery_app.conf
    ours = celery_config(settings)
    _check_content(conf)
    _check_broker(celery_app, settings)
    queues = _merged_queues(conf, ours["task_queues"])
    routes = _merged_routes(conf.task_routes, ours["task_routes"])
    beat = _merged_beat(conf.beat_schedule or {}, beat_schedule(settings))
    conf.task_queues, conf.task_routes, conf.beat_schedule = queues, routes, beat
    if conf.worker_consumer == "celery.worker.consumer:Consumer":  # an app's own one stays
        conf.worker_consumer = ours["worker_consumer"]
    register_tasks(celery_app)
    celery_app.steps["consumer"].add(FollowTaskEvents)  # job events follow -E, enable_events
    return celery_app


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """harvest's beat entries: dispatch, rescue, recurring schedules and retention ticks."""

    def entry(task: str, period: float, expires: float) -> dict[str, Any]:
        # A tick that waits longer than a few periods is useless: the next one does its work.
        # JSON whatever the app's task_serializer: harvest's workers accept only JSON.
        options = {"expires": expires, "serializer": "json"}
        return {"task": task, "schedule": period, "options": options}

    return {
        "harvest-dispatch": entry(
            DISPATCH_TASK, settings.dispatch_interval, max(5.0, settings.dispatch_interval * 5)
        ),
        "harvest-rescue": entry(
            RESCUE_TASK, settings.rescue_interval, max(10.0, settings.rescue_interval * 3)
        ),
        # Exactly one job per fire time lives in Postgres: a late or doubled tick is harmless.
        "harvest-schedules": entry(
            schedules.TASK, settings.schedules_interval, max(5.0, settings.schedules_interval * 5)
        ),
        "harvest-maintenance": entry(
            maintenance.TASK,
            settings.maintenance_interval,
            max(30.0, settings.maintenance_interval),
        ),
    }


def register_tasks(celery_app: Celery) -> None:
    """Register harvest's tasks on ``celery_app``: the functions and options of harvest's own
    app (``harvest.worker``), so both run the same code."""
    from harvest.worker.tasks import execution, schedule

    tasks = (
        schedule.dispatch,
        schedule.rescue,
        schedule.fire_schedules,
        schedule.maintain,
        execution.execute,
    )
    for task in tasks:
        options = {
            "acks_late": task.acks_late,
            "reject_on_worker_lost": task.reject_on_worker_lost,
            "ignore_result": task.ignore_result,
            "send_events": task.send_events,
        }
        celery_app.task(name=task.name, shared=False, **options)(task.run)


def _check_content(conf: Any) -> None:
    accepted = {str(c).lower() for c in conf.accept_content or ()}
    if not accepted & {"json", "application/json"}:
        raise ConfigurationError(
            f"harvest's messages are JSON, and this Celery app accepts only "
            f"{sorted(accepted)} (accept_content): add 'json' to it"
        )


def _check_broker(celery_app: Celery, settings: Settings) -> None:
    """harvest publishes to HARVEST_BROKER_URL (default HARVEST_REDIS_URL) from every process
    that enqueues: the app's workers must consume from that broker."""
    with (
        celery_app.connection_for_write() as theirs,
        Connection(settings.effective_broker_url) as ours,  # type: ignore[no-untyped-call]
    ):
        if theirs.as_uri(include_password=True) != ours.as_uri(include_password=True):
            raise ConfigurationError(
                f"this Celery app's broker is {redact_url(theirs.as_uri())} but harvest "
                f"publishes to {redact_url(ours.as_uri())}: set HARVEST_BROKER_URL to your "
                "app's broker URL"
            )


def _merged_queues(conf: Any, ours: tuple[Queue, ...]) -> tuple[Queue, ...]:
    """Their queues, plus harvest's. With none declared, their default queue is kept too (a
    worker without -Q still consumes it)."""
    theirs = list(conf.task_queues or ())
    if not theirs:
        name = conf.task_default_queue
        exchange = Exchange(conf.task_default_exchange or name, conf.task_default_exchange_type)  # type: ignore[no-untyped-call]
        theirs = [Queue(name, exchange, routing_key=conf.task_default_routing_key or name)]  # type: ignore[no-untyped-call]
    named = {q.name: q for q in theirs}
    for queue in ours:
        same = named.get(queue.name)
        if same is not None and (same.exchange.name, same.routing_key) != (
            queue.exchange.name,
            queue.routing_key,
        ):
            raise ConfigurationError(
                f"this Celery app already has a queue named {queue.name!r} (harvest's "
                "queues are 'schedule' and 'execution')"
            )
        named.setdefault(queue.name, queue)
    return tuple(named.values())


def _merged_routes(theirs: Any, ours: Mapping[str, Any]) -> Any:
    """harvest's routes (exact task names) beside theirs, whatever form theirs take."""
    if not theirs:
        return dict(ours)
    if isinstance(theirs, Mapping):
        for name, route in ours.items():
            if name in theirs and theirs[name] != route:
                raise ConfigurationError(
                    f"task_routes routes harvest's task {name!r} to {theirs[name]!r}; "
                    f"harvest needs {route!r}"
                )
        return {**theirs, **ours}
    if isinstance(theirs, list | tuple):
        return (dict(ours), *theirs)
    return (dict(ours), theirs)  # a router function or its dotted name


def _merged_beat(theirs: Mapping[str, Any], ours: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    for name, entry in ours.items():
        if name in theirs and theirs[name].get("task") != entry["task"]:
            raise ConfigurationError(
                f"beat_schedule already has an entry {name!r} for another task"
            )
    return {**theirs, **ours}


def register_job_names(celery_app: Celery, names: Iterable[str]) -> list[str]:
    """Make each job name a task of the worker's app, so that ``celery inspect registered``
    (and Flower's task types) list what this worker can run. Jobs are enqueued with
    ``app.enqueue``, never sent as Celery tasks: a message sent to one of these names by hand
    (``celery call``) fails with a line that says so. A name the app already has is left alone.
    Returns the names added."""
    added = []
    for name in sorted(names):
        if name in celery_app.tasks:
            continue

        def refuse(*_: Any, _name: str = name, **__: Any) -> None:
            raise RuntimeError(
                f"{_name!r} is a harvest job: enqueue it with app.enqueue({_name!r}, ...) or "
                "`harvest enqueue`; a Celery message cannot carry its lease"
            )

        celery_app.task(name=name, shared=False, send_events=False, ignore_result=True)(refuse)
        added.append(name)
    return added
