"""The Celery app: harvest's configuration, queues, routes and beat schedule."""

from __future__ import annotations

import logging
import os
from typing import Any

import click
from celery import Celery, bootsteps
from celery.signals import (
    beat_init,
    celeryd_init,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)
from celery.worker.consumer.consumer import INVALID_TASK_ERROR, UNKNOWN_TASK_ERROR

from harvest.broker import celery_config, sized_for_pool
from harvest.redact import redact_text
from harvest.worker import checks, runtime
from harvest.worker.events import FollowTaskEvents
from harvest.worker.install import beat_schedule, register_job_names


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

settings = checks.settings_or_exit()

# Not made the current app: a process that only imports it (harvest.install does, for the
# task definitions) keeps its own; `celery -A harvest.worker` makes it current anyway.
app = Celery("harvest", set_as_current=False)
app.conf.update(celery_config(settings))
app.conf.imports = ("harvest.worker.tasks.schedule", "harvest.worker.tasks.execution")
app.conf.beat_scheduler = "harvest.worker.beat:LeaderScheduler"
app.conf.beat_schedule = beat_schedule(settings)

# Fail fast: a worker or beat that cannot work exits at start with one line naming why.
celeryd_init.connect(checks.worker_starting, weak=False)
beat_init.connect(checks.beat_starting, weak=False)


@worker_process_init.connect
def _after_fork(**_: Any) -> None:
    """Each prefork child builds its own engine and clients (see harvest.worker.runtime), and
    an execution child says it is alive (the dispatcher sizes the in-flight window by it).
    harvest's loggers keep the level the worker was started with (``-l``), as Celery's do."""
    if runtime.executes():
        runtime.executor().start_presence()


@worker_ready.connect
def _ready(**_: Any) -> None:
    """With -P solo, threads or gevent, jobs run in the worker's own process."""
    if runtime.shape().pool != "prefork" and runtime.executes():
        runtime.executor().start_presence()


class _AsyncConcurrency(bootsteps.Step):  # type: ignore[misc]
    """``celery worker --async-concurrency N``: async jobs per process
    (``HARVEST_ASYNC_CONCURRENCY``), set before the pool forks."""

    def __init__(self, worker: Any, async_concurrency: int | None = None, **options: Any) -> None:
        if async_concurrency is not None:
            os.environ["HARVEST_ASYNC_CONCURRENCY"] = str(async_concurrency)
        super().__init__(worker, **options)


app.user_options["worker"].add(
    click.Option(
        ("--async-concurrency",),
        type=int,
        default=None,
        help="harvest: async jobs each process runs at once (default HARVEST_ASYNC_CONCURRENCY).",
    )
)
app.steps["worker"].add(_AsyncConcurrency)
app.steps["consumer"].add(FollowTaskEvents)  # job events follow -E and enable_events


@worker_init.connect
def _worker_init(sender: Any = None, **_: Any) -> None:
    """Record how Celery runs tasks (pool, concurrency, queues) and refuse what harvest cannot
    run safely, with one line."""
    for noisy in ("httpx", "httpcore"):  # a line per HTTP request; the job lines say enough
        if logging.getLogger(noisy).level == logging.NOTSET:
            logging.getLogger(noisy).setLevel(logging.WARNING)
    pool = pool_name(getattr(sender, "pool_cls", "prefork"))
    if pool == "eventlet":
        refuse("harvest does not run on -P eventlet: use -P gevent or -P threads for sync jobs")
    queues = sorted(getattr(sender.app.amqp.queues, "consume_from", None) or {}) if sender else []
    concurrency = int(getattr(sender, "concurrency", 1) or 1)
    if sender is not None:  # before the consumer connects
        conf = sender.app.conf
        options = dict(conf.broker_transport_options or {})
        url = str(conf.broker_url or "")
        conf.broker_transport_options = sized_for_pool(options, url, pool, concurrency)
    runtime.configure(
        pool,
        concurrency,
        queues,
        hostname=str(getattr(sender, "hostname", "") or ""),
        celery=getattr(sender, "app", None),
    )
    if runtime.executes() and sender is not None:  # `celery inspect registered` lists jobs
        register_job_names(sender.app, runtime.harvest().jobs)
    if pool == "gevent" and any(spec.is_async for spec in runtime.harvest().jobs.values()):
        refuse(
            "harvest runs async def jobs on its own event loop, which cannot share a process "
            "with gevent: run them on a worker with -P prefork, solo or threads (another -Q)"
        )


@worker_process_shutdown.connect
def _child_exits(**_: Any) -> None:
    """A prefork child stops: its async jobs finish or are handed back (warm shutdown)."""
    runtime.shutdown()


@worker_shutdown.connect
def _worker_exits(**_: Any) -> None:
    """The worker stops: with -P solo, threads or gevent its jobs ran in this process."""
    runtime.shutdown()


def pool_name(pool_cls: Any) -> str:
    """Celery's pool class (or its alias) as harvest names it: prefork, solo, threads, gevent."""
    name = pool_cls if isinstance(pool_cls, str) else getattr(pool_cls, "__module__", "")
    last = name.rsplit(".", 1)[-1].split(":")[0]
    return {"thread": "threads", "processes": "prefork"}.get(last, last)


def refuse(line: str) -> None:
    """Stop the worker at start with one line on stderr, no traceback."""
    checks.refuse("harvest worker", line)
