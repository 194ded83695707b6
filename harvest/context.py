"""What a handler receives: the job's identity and attempt, and its leases."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

from harvest.errors import InvalidOption, KeyRejected, LeaseLost, RateLimited


class CancelFlag:
    """A job's cancellation, once asked for: set by the heartbeat (a thread, or a task of the
    event loop), read by the handler (``ctx.cancelled``). Nothing waits on it, so it is a plain
    attribute (one store and one load under the GIL), not a ``threading.Event``: making an
    Event (its Condition and lock) for every job was 2 µs of an async job's turn of the loop."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


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
    aclients: Any = field(default=None, repr=False)  # the event loop's AsyncClients (async jobs)
    _lease_check: Callable[[], bool] | None = field(default=None, repr=False)
    _alease_check: Callable[[], Awaitable[bool]] | None = field(default=None, repr=False)
    _cancel: CancelFlag = field(default_factory=CancelFlag, repr=False)
    _used: Callable[[int], None] | None = field(default=None, repr=False)
    _observe: Callable[[Any], None] | None = field(default=None, repr=False)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def last_attempt(self) -> bool:
        return self.attempt >= self.max_attempts

    @property
    def pool(self) -> str | None:
        """The key pool that served this attempt (of a job with fallback pools, the first that
        had a key free); None for a job without a pool."""
        return getattr(self.lease, "pool", None)

    @contextmanager
    def client(self) -> Iterator[Any]:
        """An ``httpx.Client`` that sends the leased key as a bearer token, borrowed from
        this worker's per-key pool (connections are reused across jobs of the same key)."""
        if self.lease is None or self.key is None or self.clients is None:
            raise RuntimeError("ctx.client() needs a job declared with pool=...")
        self.check_lease()
        with self.clients.borrow(self.lease.key_id, self.key) as http:
            yield http

    @asynccontextmanager
    async def aclient(self) -> AsyncIterator[Any]:
        """In an ``async def`` handler: an ``httpx.AsyncClient`` that sends the leased key as a
        bearer token, shared by this worker's jobs on the same key (its connections are
        kept alive across them). Checks the key lease before each use, as ``client()`` does."""
        if self.lease is None or self.key is None or self.aclients is None:
            raise RuntimeError("ctx.aclient() needs an async job declared with pool=...")
        await self.acheck_lease()
        yield self.aclients.get(self.lease.key_id, self.key)

    async def acheck_lease(self) -> None:
        """:meth:`check_lease` for async handlers (no I/O while the lease was renewed lately)."""
        if self._alease_check is not None and not await self._alease_check():
            raise LeaseLost(
                "this attempt's lease was lost (paused or cut off): not calling with the key"
            )

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

    def used(self, *, tokens: int) -> None:
        """Report the tokens this attempt's call used (e.g. the response's
        ``usage.total_tokens``); called more than once, the figures add up. When the key is
        released, the tokens reserved for the job's ``cost`` become this figure: more is
        charged to the key's token budget, less is refunded. Without a report, the reservation
        stands as used. In sync and ``async def`` handlers alike (no I/O)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise InvalidOption("tokens", f"must be a whole number >= 0, got {tokens!r}")
        if self._used is not None:
            self._used(tokens)

    def observe(self, response: Any) -> None:
        """Show harvest the service's answer (an ``httpx.Response``, or any object with
        ``headers``, or the headers themselves) so the key follows its rate-limit headers
        (``x-ratelimit-remaining-requests`` / ``-reset-requests`` and ``-tokens``, or
        Anthropic's ``anthropic-ratelimit-*``): until the announced reset the key is leased only
        for what the service said is left. Call it on every answer, a 429 too (a 429 that the
        headers explain does not lower the key's learned limits). No I/O; the last one counts."""
        headers = getattr(response, "headers", response)
        if not hasattr(headers, "items"):
            raise InvalidOption("response", f"needs headers, got {type(response).__name__}")
        if self._observe is not None:
            self._observe(headers)

    def rate_limited(self, retry_after: float) -> NoReturn:
        """The service answered 429 (Retry-After: ``retry_after`` s): the key rests that long
        and the job retries on another key, without using up an attempt."""
        raise RateLimited(retry_after, name=self.pool)

    def key_rejected(self, reason: str = "the service rejected the API key") -> NoReturn:
        """The service refused the key (401/403): it is disabled and the job retries on
        another key, without using up an attempt."""
        raise KeyRejected(reason)
