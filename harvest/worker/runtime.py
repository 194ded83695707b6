"""The worker process's Harvest object and executor: built once per process from the
environment, rebuilt in each forked child (no connection, thread or event loop crosses a fork:
the executor's loop and threads start on first use, in the process that uses them)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harvest.app import Harvest
from harvest.broker import SCHEDULE_QUEUE
from harvest.db import make_engine
from harvest.execution.executor import Executor
from harvest.joblog import JobLog
from harvest.settings import load_settings
from harvest.worker.events import SWITCH, TaskEvents

POOLS_WITH_THREADS = ("threads", "gevent")
THREAD_POOL_CAP = 20  # Postgres connections one -P threads / gevent worker process may open


@dataclass(frozen=True, slots=True)
class WorkerShape:
    """How Celery runs this worker's tasks (from its command line)."""

    pool: str = "prefork"  # prefork, solo, threads, gevent
    concurrency: int = 1
    queues: tuple[str, ...] = ()
    hostname: str = ""  # Celery's node name (execution@host): the events' sender
    celery: Any = None  # the Celery app the worker runs (harvest's own, or the project's)


_state: dict[str, object] = {}
_shape = [WorkerShape()]


def configure(
    pool: str,
    concurrency: int,
    queues: Sequence[str],
    hostname: str = "",
    celery: Any = None,
) -> None:
    """Called once in the worker's main process (Celery's ``worker_init``), before any fork."""
    _shape[0] = WorkerShape(pool, max(1, concurrency), tuple(queues), hostname, celery)


def shape() -> WorkerShape:
    return _shape[0]


def executes() -> bool:
    """True when this worker consumes a queue of jobs (any queue but ``schedule``)."""
    return any(queue != SCHEDULE_QUEUE for queue in shape().queues)


def harvest() -> Harvest:
    app = _state.get("harvest")
    if not isinstance(app, Harvest) or _state.get("pid") != os.getpid():
        settings = load_settings()
        current = shape()
        if current.pool in POOLS_WITH_THREADS:
            # Threads (or greenlets) hold a connection only for each statement: a pool of up
            # to THREAD_POOL_CAP serves hundreds of them (a checkout waits up to 10 s).
            size = max(settings.db_pool_size, min(current.concurrency, THREAD_POOL_CAP) + 2)
            settings = settings.model_copy(update={"db_pool_size": size})
        engine = make_engine(settings, execution=True) if executes() else None
        app = Harvest(settings, engine=engine)
        if settings.job_log != "off":  # a line per attempt at its start and its end
            app.observers.add(JobLog(settings.log_format, lines=settings.job_log))
        if settings.task_events is not False and current.celery is not None and executes():
            switch = None if settings.task_events else SWITCH  # unset: as the worker's -E is
            app.observers.add(TaskEvents(current.celery, current.hostname, switch))  # Flower
        app.load_imports()
        _state.clear()
        _state.update(harvest=app, pid=os.getpid())
    return app


def executor() -> Executor:
    app = harvest()  # resets state after a fork
    current = _state.get("executor")
    if not isinstance(current, Executor):
        s = shape()
        current = Executor(app, pool=s.pool, concurrency=s.concurrency, queues=s.queues)
        _state["executor"] = current
    return current


def shutdown() -> None:
    """Warm shutdown of this process's executor, if it made one."""
    current = _state.get("executor")
    if isinstance(current, Executor) and _state.get("pid") == os.getpid():
        current.shutdown()
        del _state["executor"]
