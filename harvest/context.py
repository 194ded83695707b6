"""What a handler receives: the job's identity and attempt, and its leases."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

from harvest.errors import KeyRejected, LeaseLost, RateLimited


@dataclass(slots=True)
class JobContext:
    """Passed as the first argument of every handler.

    ``job_id`` and ``attempt`` let a handler make its external effects idempotent (at-least-once
    execution: a handler may run again after a crash). ``cancelled`` turns true when someone
    cancels the job while it runs; long handlers should check it and return.
    """

    job_id: int
    attempt: int
    max_attempts: int
    name: str
    key: str | None = field(default=None, repr=False)  # the pool's secret, inside handlers only
    lease: Any = None  # the key lease, when the job declares a pool
    clients: Any = field(default=None, repr=False)  # the worker's ClientPool of HTTP clients
    _lease_check: Callable[[], bool] | None = field(default=None, repr=False)
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def last_attempt(self) -> bool:
        return self.attempt >= self.max_attempts

    @contextmanager
    def client(self) -> Iterator[Any]:
        """An ``httpx.Client`` that sends the leased key as a bearer token, borrowed from
        this worker's per-key pool (connections are reused across jobs of the same key)."""
        if self.lease is None or self.key is None or self.clients is None:
            raise RuntimeError("ctx.client() needs a job declared with pool=...")
        self.check_lease()
        with self.clients.borrow(self.lease.key_id, self.key) as http:
            yield http

    def check_lease(self) -> None:
        """Raise LeaseLost unless this attempt still holds its job lease and its key lease.

        A worker paused (or cut off) past its leases may resume in the middle of a handler,
        after its key went to another holder: calling the service then would put the key over
        its limit. ``ctx.client()`` checks before every use; a handler that uses ``ctx.key``
        directly should call this right before each call."""
        if self._lease_check is not None and not self._lease_check():
            raise LeaseLost(
                "this attempt's lease was lost (paused or cut off): not calling with the key"
            )

    def rate_limited(self, retry_after: float) -> NoReturn:
        """The service answered 429 (Retry-After: ``retry_after`` s): the key rests that long
        and the job retries on another key, without using up an attempt."""
        raise RateLimited(retry_after, name=getattr(self.lease, "pool", None))

    def key_rejected(self, reason: str = "the service rejected the API key") -> NoReturn:
        """The service refused the key (401/403): it is disabled and the job retries on
        another key, without using up an attempt."""
        raise KeyRejected(reason)
