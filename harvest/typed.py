"""What ``@app.job`` returns: the handler, callable as before, that can enqueue itself with its
own parameters, checked by mypy.

>>> @app.job("fetch_page")
... def fetch_page(ctx: JobContext, url: str, depth: int = 0) -> dict: ...
>>> fetch_page.enqueue(url="https://example.org")                 # typed: url: str, depth: int
>>> fetch_page.options(priority=5, delay=10).enqueue("https://example.org", depth=1)

The options (priority, delay, ...) live on :meth:`JobFunction.options` because a ParamSpec's
keyword arguments cannot share a signature with other keyword parameters (PEP 612).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

from harvest.errors import InvalidPayload

if TYPE_CHECKING:
    from harvest.app import Harvest
    from harvest.context import JobContext
    from harvest.jobs import JobRef
    from harvest.transactional import CallerConnection

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Options:
    """Keyword options of :meth:`harvest.Harvest.enqueue` (see there)."""

    priority: int = 0
    delay: float | timedelta | None = None
    run_at: datetime | None = None
    idempotency_key: str | None = None
    max_attempts: int | None = None
    wait: float | None = None
    connection: CallerConnection | None = field(default=None, repr=False)
    tenant: str | None = None


class Enqueuer(Generic[P]):
    """A job with its enqueue options chosen: ``.enqueue(...)`` takes the handler's parameters."""

    def __init__(self, job: JobFunction[P, Any], options: Options) -> None:
        self._job = job
        self._options = options

    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> JobRef:
        """Enqueue the job with these arguments (the handler's own, without ``ctx``)."""
        o = self._options
        return self._job.app.enqueue(
            self._job.name,
            self._job.payload(args, kwargs),
            priority=o.priority,
            delay=o.delay,
            run_at=o.run_at,
            idempotency_key=o.idempotency_key,
            max_attempts=o.max_attempts,
            wait=o.wait,
            connection=o.connection,
            tenant=o.tenant,
        )


class JobFunction(Generic[P, R]):
    """A registered handler: call it as the function it wraps, or enqueue it as a job."""

    def __init__(
        self, app: Harvest, name: str, func: Callable[Concatenate[JobContext, P], R]
    ) -> None:
        self.app = app
        self.name = name
        self.func = func
        self._names = _parameter_names(func)
        functools.update_wrapper(self, func)

    def __call__(self, ctx: JobContext, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.func(ctx, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<job {self.name!r}: {self.func.__module__}.{self.func.__qualname__}>"

    def enqueue(self, *args: P.args, **kwargs: P.kwargs) -> JobRef:
        """Enqueue the job with the handler's arguments (without ``ctx``), default options."""
        return Enqueuer(self, Options()).enqueue(*args, **kwargs)

    def options(
        self,
        *,
        priority: int = 0,
        delay: float | timedelta | None = None,
        run_at: datetime | None = None,
        idempotency_key: str | None = None,
        max_attempts: int | None = None,
        wait: float | None = None,
        connection: CallerConnection | None = None,
        tenant: str | None = None,
    ) -> Enqueuer[P]:
        """Choose enqueue options, then call ``.enqueue(...)`` with the handler's arguments;
        each option is that of :meth:`harvest.Harvest.enqueue`."""
        chosen = Options(
            priority, delay, run_at, idempotency_key, max_attempts, wait, connection, tenant
        )
        return Enqueuer(self, chosen)

    def payload(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The JSON payload of a call: positional arguments named after the handler's
        parameters, then the keyword arguments (checked against the handler at enqueue)."""
        if len(args) > len(self._names):
            raise InvalidPayload(
                f"{len(args)} positional arguments, but {self.name!r} names only "
                f"{len(self._names)}: pass the others by keyword"
            )
        named = dict(zip(self._names, args, strict=False))
        twice = sorted(named.keys() & kwargs.keys())
        if twice:
            raise InvalidPayload(f"{', '.join(twice)} given both by position and by keyword")
        return {**named, **kwargs}


def _parameter_names(func: Callable[..., Any]) -> list[str]:
    """The names a positional argument can fill, after ``ctx``."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [p for p in inspect.signature(func).parameters.values() if p.kind in kinds]
    return [p.name for p in params[1:]]
