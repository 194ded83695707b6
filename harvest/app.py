"""The Harvest object: the job registry, the clients, and enqueue (with backpressure) and
batches (written in :mod:`harvest.enqueueing`), schedules, get, wait, cancel and retry."""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import redis
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from harvest import store, validation
from harvest.backpressure import DepthGauge
from harvest.batches import Batch
from harvest.broker import Broker
from harvest.controls import Controls
from harvest.coordination import fallback
from harvest.coordination import keys as rkeys
from harvest.coordination.key_pool import check_cost
from harvest.db import make_engine, make_sessionmaker, translate_errors
from harvest.enqueueing import Enqueueing
from harvest.errors import (
    BatchNotFound,
    ConfigurationError,
    HarvestError,
    InvalidCost,
    InvalidOption,
    JobNotFound,
    UnknownJob,
    WaitTimeout,
)
from harvest.execution.observe import Observers
from harvest.jobs import Job, JobRef, job_id_of
from harvest.models import JobStatus
from harvest.retry import RetryPolicy
from harvest.settings import Settings
from harvest.typed import JobFunction

if TYPE_CHECKING:
    from harvest.context import JobContext

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A registered job: its handler and how it runs."""

    name: str
    func: Callable[..., Any]
    queue: str
    max_attempts: int
    timeout: float
    retry_on: tuple[type[BaseException], ...]
    retry: RetryPolicy
    pool: str | None = None  # its key pools, first choice first, joined by "," (as its rows)
    rate_limit: str | None = None
    max_depth: int | None = None  # most pending jobs of this name (backpressure)
    cost: int | Callable[[dict[str, Any]], int] | None = None  # tokens a call will use

    def cost_of(self, payload: Mapping[str, Any] | None) -> int:
        """Tokens to reserve on the key for one attempt with ``payload`` (0: no token check).

        :raises InvalidCost: the cost function failed or gave no whole number >= 0."""
        if self.cost is None:
            return 0
        if not callable(self.cost):
            return self.cost
        try:
            value = self.cost(dict(payload or {}))
        except Exception as exc:
            raise InvalidCost(f"the cost function of {self.name!r} raised {exc!r}") from exc
        try:
            return check_cost(value)
        except ValueError:
            raise InvalidCost(
                f"the cost function of {self.name!r} returned {value!r}: "
                "must be a whole number of tokens >= 0"
            ) from None

    @property
    def is_async(self) -> bool:
        """True for an ``async def`` handler: it runs on the worker's event loop, many at once."""
        return inspect.iscoroutinefunction(self.func)


@dataclass(slots=True)
class _Lazy:
    """Clients made on first use, so that a forked worker child makes its own."""

    engine: Engine | None = None
    sessions: sessionmaker[Session] | None = None
    broker: Broker | None = None
    redis: redis.Redis | None = None
    last_nudge: float = field(default=0.0)
    gauge: DepthGauge = field(default_factory=DepthGauge)


class Harvest(Enqueueing, Controls):
    """The entry point of the library.

    >>> app = Harvest()            # settings from HARVEST_* environment variables
    >>> @app.job(max_attempts=5)
    ... def fetch(ctx, url): ...
    >>> ref = app.enqueue("fetch", {"url": "https://example.org"})
    >>> app.wait(ref.id, timeout=30).status
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        engine: Engine | None = None,
        broker: Broker | None = None,
        redis_client: redis.Redis | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.jobs: dict[str, JobSpec] = {}
        self.observers = Observers()  # attempt events: job-level logs, Celery task events
        self._lazy = _Lazy(engine=engine, broker=broker, redis=redis_client)

    # --- registry ---------------------------------------------------------------------------

    def job(
        self,
        name: str | None = None,
        *,
        queue: str = "execution",
        max_attempts: int = 3,
        timeout: float | None = None,
        retry_on: tuple[type[BaseException], ...] = (Exception,),
        retry: RetryPolicy | None = None,
        pool: str | Sequence[str] | None = None,
        rate_limit: str | None = None,
        max_depth: int | None = None,
        cost: int | Callable[[dict[str, Any]], int] | None = None,
    ) -> Callable[[Callable[Concatenate[JobContext, P], R]], JobFunction[P, R]]:
        """Register ``handler(ctx: JobContext, **payload)`` as a job; ``async def`` handlers
        run many at once on each worker process's event loop (see the README's "Choosing how
        jobs run").

        :param name: the job's name (default: the function's ``module.qualname``).
        :param queue: the Celery queue its messages go to (workers consume it with ``-Q``).
        :param max_attempts: attempts before the job is failed (dead) with its last error.
        :param timeout: seconds an attempt may run (default ``settings.default_timeout``).
        :param retry_on: exceptions that retry; any other exception fails the job at once.
        :param retry: the backoff policy (default: exponential from ``settings.retry_base``).
        :param pool: the API key pool that gates this job (``ctx.key`` inside the handler),
            or a list of pools to fall back on, first choice first (``ctx.pool`` says which
            one served). Refused with :class:`~harvest.errors.InvalidPool` when malformed.
        :param rate_limit: a global rate limit across all workers, e.g. ``"100/m"``.
        :param max_depth: most pending jobs of this name; enqueue beyond it raises
            :class:`~harvest.errors.JobDepthFull` (a QueueFull). The queue's own limit
            (``max_queue_depth``) applies as well.
        :param cost: tokens one call will use, reserved on the leased key's token budget
            (``--tpm``) before the handler runs: a whole number, or a function of the payload
            (a dict) returning one. The handler reports what it used with ``ctx.used(tokens=)``.
            None (the default): no token check. Needs ``pool``.
        :returns: a :class:`~harvest.typed.JobFunction`: call it as the handler, or enqueue
            it with the handler's own parameters, ``fetch.enqueue(url=...)`` (typed).
        """
        validation.check_queue(queue)
        pools = fallback.route(pool)
        _check_job_options(max_attempts=max_attempts, pool=pool, max_depth=max_depth, cost=cost)
        limit = validation.check_timeout(
            timeout if timeout is not None else self.settings.default_timeout,
            maximum=self.settings.max_timeout,
        )
        policy = retry or RetryPolicy(
            base=self.settings.retry_base, max_delay=self.settings.retry_max
        )

        def register(func: Callable[Concatenate[JobContext, P], R]) -> JobFunction[P, R]:
            if isinstance(func, JobFunction):  # registered on another app first
                func = func.func
            job_name = name or f"{func.__module__}.{func.__qualname__}"
            self._register(JobSpec(
                job_name, func, queue, max_attempts, limit, tuple(retry_on), policy, pools,
                rate_limit, max_depth, cost,
            ))  # fmt: skip
            return JobFunction(self, job_name, func)

        return register

    def _register(self, spec: JobSpec) -> None:
        """Add ``spec`` to the registry; InvalidOption if another handler has its name."""
        if spec.name in self.jobs and self.jobs[spec.name].func is not spec.func:
            raise InvalidOption("name", f"job {spec.name!r} is already registered")
        self.jobs[spec.name] = spec

    def load_imports(self, modules: Iterable[str] | None = None) -> None:
        """Import the modules that define jobs (``HARVEST_IMPORTS``) and take the jobs
        registered on every Harvest object found at their top level.

        The current directory is importable, as it is for ``celery -A`` and ``python -m``: a
        ``myjobs.py`` beside where the worker, beat or CLI starts is found without PYTHONPATH."""
        cwd = os.getcwd()
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        for module_name in modules if modules is not None else self.settings.imports:
            module = _import_jobs(module_name, cwd)
            for value in vars(module).values():
                if isinstance(value, Harvest) and value is not self:
                    self.jobs.update(value.jobs)

    def spec(self, name: str) -> JobSpec:
        try:
            return self.jobs[name]
        except KeyError:
            raise UnknownJob(name, list(self.jobs)) from None

    # --- clients ----------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        if self._lazy.engine is None:
            self._lazy.engine = make_engine(self.settings)
        return self._lazy.engine

    @property
    def sessions(self) -> sessionmaker[Session]:
        if self._lazy.sessions is None:
            self._lazy.sessions = make_sessionmaker(self.engine)
        return self._lazy.sessions

    @property
    def broker(self) -> Broker:
        if self._lazy.broker is None:
            self._lazy.broker = Broker(self.settings)
        return self._lazy.broker

    @property
    def redis(self) -> redis.Redis:
        if self._lazy.redis is None:
            self._lazy.redis = redis.Redis.from_url(
                self.settings.redis_url, socket_timeout=5, socket_connect_timeout=5
            )
        return self._lazy.redis

    def after_fork(self) -> None:
        """Forget the parent's connections (call in each forked child before first use)."""
        if self._lazy.engine is not None:
            self._lazy.engine.dispose(close=False)
        self._lazy.redis = None
        self._lazy.broker = None
        self._lazy.gauge = DepthGauge()

    def close(self) -> None:
        if self._lazy.engine is not None:
            self._lazy.engine.dispose()
        if self._lazy.redis is not None:
            self._lazy.redis.close()
        if self._lazy.broker is not None:
            self._lazy.broker.close()
        self._lazy = _Lazy()

    def batch(self, batch_id: int) -> Batch:
        """A batch's progress: total, succeeded, failed, cancelled, pending, the callback."""
        with translate_errors(), self.engine.connect() as conn:
            row = store.get_batch(conn, batch_id)
        if row is None:
            raise BatchNotFound(batch_id)
        return Batch.from_row(row)

    def nudge(self) -> None:
        """Ask the dispatcher to look now instead of at its next beat tick. Coalesced through
        Redis: one nudge per ``nudge_coalesce_ms`` across all processes. Best effort: when Redis
        or the broker is down the job is still stored, and beat finds it."""
        if self._nudge_due():
            self._send_nudge()

    def nudge_soon(self) -> None:
        """:meth:`nudge` from code that must not block (an event loop): the nudge, when one is
        due at all, is sent from a short-lived thread."""
        if self._nudge_due():
            threading.Thread(target=self._send_nudge, name="harvest-nudge", daemon=True).start()

    def _nudge_due(self) -> bool:
        now = time.monotonic()
        if now - self._lazy.last_nudge < self.settings.nudge_coalesce_ms / 1000:
            return False  # this process nudged (or saw a nudge pending) within the window
        self._lazy.last_nudge = now
        return True

    def _send_nudge(self) -> None:
        try:
            if self.redis.set(rkeys.nudge(), b"1", nx=True, px=self.settings.nudge_coalesce_ms):
                self.broker.nudge_dispatch()
        except Exception as exc:
            log.warning(
                "dispatch nudge not sent (%s); beat will pick the job up", type(exc).__name__
            )

    # --- reading and cancelling -------------------------------------------------------------

    def get(self, job_id: int | JobRef | Job) -> Job:
        """The job (its id, or the JobRef enqueue returned); JobNotFound if there is none."""
        job_id = job_id_of(job_id)
        with translate_errors(), self.engine.begin() as conn:  # begin: a quarantine is kept
            found = store.get(conn, job_id)
        if found is None:
            raise JobNotFound(job_id)
        return found

    def wait(self, job_id: int | JobRef | Job, timeout: float = 60.0, *, poll: float = 0.05) -> Job:
        """Block until the job is succeeded, failed or cancelled; WaitTimeout after ``timeout``."""
        job_id = job_id_of(job_id)
        deadline = time.monotonic() + timeout
        interval = poll
        while True:
            with translate_errors(), self.engine.connect() as conn:
                status = store.status_of(conn, job_id)
            if status is None:
                raise JobNotFound(job_id)
            if status.terminal:
                return self.get(job_id)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeout(job_id, timeout, str(status))
            time.sleep(min(interval, remaining))
            interval = min(interval * 1.5, 1.0)

    def cancel(self, job_id: int | JobRef | Job) -> JobStatus:
        """Cancel a job: a pending one ends cancelled at once and never runs; a running one is
        asked to stop (``ctx.cancelled``) and ends cancelled. Returns the status now."""
        job_id = job_id_of(job_id)
        with translate_errors(), self.engine.begin() as conn:
            status = store.cancel(conn, job_id)
            if status is None:
                current = store.status_of(conn, job_id)
                if current is None:
                    raise JobNotFound(job_id)
                return current
        return status

    def retry(self, job_id: int | JobRef | Job) -> None:
        """A failed (dead) job back to pending, with one more attempt allowed."""
        job_id = job_id_of(job_id)
        with translate_errors(), self.engine.begin() as conn:
            ok = store.retry_failed(conn, job_id)
            if not ok:
                current = store.status_of(conn, job_id)
                if current is None:
                    raise JobNotFound(job_id)
                raise HarvestError(
                    f"job {job_id} is {current}, not failed (only dead jobs can be retried)"
                )
        self.nudge()

    def retry_failed(self, *, name: str | None = None, batch_size: int = 1000) -> int:
        """Every failed (dead) job, or those of one name, back to pending with one more attempt
        allowed, in batches of ``batch_size`` rows. Returns how many."""
        total = 0
        while True:
            with translate_errors(), self.engine.begin() as conn:
                n = len(store.retry_failed_many(conn, name=name, limit=batch_size))
            total += n
            if n < batch_size:
                break
        if total:
            self.nudge()
        return total


def _import_jobs(name: str, cwd: str) -> Any:
    """Import a module of HARVEST_IMPORTS; what goes wrong is a ConfigurationError naming it
    (the error it raised is its cause)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and f"{name}.".startswith(f"{exc.name}."):  # it, or its package
            raise ConfigurationError(
                f"HARVEST_IMPORTS: no module named {name!r} (looked in {cwd} and sys.path)"
            ) from exc
        raise ConfigurationError(_raised_at_import(name, exc)) from exc
    except Exception as exc:
        raise ConfigurationError(_raised_at_import(name, exc)) from exc


def _raised_at_import(name: str, exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    detail = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return f"HARVEST_IMPORTS: importing {name!r} raised {detail}"


def _check_job_options(
    *,
    max_attempts: int,
    pool: str | Sequence[str] | None,
    max_depth: int | None,
    cost: int | Callable[[dict[str, Any]], int] | None,
) -> None:
    """The options of :meth:`Harvest.job` checked alone: InvalidOption naming the wrong one."""
    validation.check_max_attempts(max_attempts)
    if max_depth is not None and (
        isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1
    ):
        raise InvalidOption(
            "max_depth", f"must be a positive integer, got {validation.shown(max_depth)}"
        )
    if cost is not None:
        if pool is None:
            raise InvalidOption("cost", "a token cost needs pool=... (it is reserved on a key)")
        if not callable(cost):
            _check_cost(cost, "got")


def _check_cost(value: Any, what: str) -> int:
    """A token cost: a whole number 0..10^12, or InvalidOption naming what was given."""
    try:
        return check_cost(value)
    except ValueError:
        raise InvalidOption(
            "cost", f"{what} {validation.shown(value)}: must be a whole number of tokens >= 0"
        ) from None
