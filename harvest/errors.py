"""One exception tree. Errors carry data; driver errors are translated at one boundary."""

from __future__ import annotations


class HarvestError(Exception):
    """Base of every error harvest raises on purpose."""


class ConfigurationError(HarvestError):
    """A setting is missing or wrong (the message names it)."""


class ServiceUnavailable(HarvestError):
    """Postgres or Redis did not answer. The message names which, never its password."""

    def __init__(self, service: str, detail: str) -> None:
        self.service = service
        self.detail = detail
        super().__init__(f"{service} is unavailable: {detail}")


class StartupProblem(HarvestError):
    """Why a worker or beat cannot start (harvest.worker.checks); ``code`` is its exit code."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)


# --- refused at the door --------------------------------------------------------------------


class EnqueueError(HarvestError, ValueError):
    """A job was refused at enqueue; nothing was stored."""

    index: int | None = None

    def at_item(self, index: int) -> EnqueueError:
        """Name the offending item of a bulk enqueue in the message."""
        self.index = index
        self.args = (f"item {index}: {self.args[0]}", *self.args[1:])
        return self


class UnknownJob(EnqueueError):
    def __init__(self, name: str, known: list[str] | None = None) -> None:
        self.name = name
        hint = f" (registered: {', '.join(sorted(known))})" if known else " (no job is registered)"
        super().__init__(f"unknown job {name!r}{hint}")


class InvalidPayload(EnqueueError):
    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"invalid payload: {reason}")


class PayloadTooLarge(InvalidPayload):
    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.limit = limit
        super().__init__(f"payload is {size} bytes as JSON, over the limit of {limit} bytes")


class InvalidOption(EnqueueError):
    def __init__(self, option: str, reason: str) -> None:
        self.option = option
        super().__init__(f"invalid {option}: {reason}")


class QueueFull(EnqueueError):
    def __init__(self, queue: str, depth: int, limit: int) -> None:
        self.queue, self.depth, self.limit = queue, depth, limit
        super().__init__(f"queue {queue!r} is full: {depth} pending, limit {limit}")


class JobDepthFull(QueueFull):
    """A job name's own ``max_depth`` of pending jobs is reached (a QueueFull: catch either)."""

    def __init__(self, name: str, queue: str, depth: int, limit: int) -> None:
        self.name = name
        self.queue, self.depth, self.limit = queue, depth, limit
        EnqueueError.__init__(
            self, f"job {name!r} is full: {depth} pending, its max_depth is {limit}"
        )


class InvalidSchedule(InvalidOption):
    """A schedule was refused (``option`` names the field); nothing was stored."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason)
        self.field = field


class InvalidKey(HarvestError, ValueError):
    """An API key was refused (bad pool, name, limit, rate or secret); nothing was stored.
    ``field`` names what is wrong; the message never contains a secret."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"invalid {field}: {reason}")


class AlreadyEnqueued(HarvestError):
    """Informational: an idempotency key matched an existing job."""

    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        super().__init__(f"a job with this idempotency key exists: {job_id}")


# --- looking jobs up ------------------------------------------------------------------------


class JobNotFound(HarvestError, LookupError):
    def __init__(self, job_id: int) -> None:
        self.job_id = job_id
        super().__init__(f"no job with id {job_id}")


class InvalidJobId(HarvestError, TypeError):
    """What was given for a job is neither its id (an int) nor what enqueue returned or get
    gave (a JobRef or a Job); ``given`` names its type, never its value."""

    def __init__(self, given: object) -> None:
        self.given = type(given).__name__
        super().__init__(f"a job is named by its id (int), JobRef or Job, not by a {self.given}")


class ScheduleNotFound(HarvestError, LookupError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no schedule named {name!r}")


class QueueNotFound(HarvestError, LookupError):
    """No job is registered on the queue, none is stored in it, and it is not paused."""

    def __init__(self, queue: str, known: list[str] | None = None) -> None:
        self.queue = queue
        hint = f" (known: {', '.join(sorted(known))})" if known else ""
        super().__init__(f"unknown queue {queue!r}{hint}")


class BatchNotFound(HarvestError, LookupError):
    def __init__(self, batch_id: int) -> None:
        self.batch_id = batch_id
        super().__init__(f"no batch with id {batch_id}")


class WaitTimeout(HarvestError, TimeoutError):
    def __init__(self, job_id: int, timeout: float, status: str) -> None:
        self.job_id, self.timeout, self.status = job_id, timeout, status
        super().__init__(f"job {job_id} still {status} after {timeout:g}s")


# --- raised inside or about running jobs ----------------------------------------------------


class JobTimeout(HarvestError):
    """Raised inside a handler that ran past its time limit."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        super().__init__(f"job ran past its time limit of {timeout:g}s")


class PermanentError(HarvestError):
    """Raise from a handler to fail the job at once, without retries."""


class InvalidPool(InvalidOption):
    """A job's ``pool=`` was refused: not a pool name or a list of them, an empty list, a name
    listed twice, or a name that is not a valid pool name. ``pools`` is what was given."""

    def __init__(self, pools: object, reason: str) -> None:
        self.pools = pools
        self.reason = reason
        super().__init__("pool", reason)


class InvalidCost(InvalidOption, PermanentError):
    """A job's token cost that cannot be served: its cost function failed or gave no whole
    number, or it is more than any key of its pool allows per minute. The attempt fails without
    a call, and without retries (the same payload would cost the same)."""

    def __init__(self, reason: str) -> None:
        super().__init__("cost", reason)


class Retry(HarvestError):
    """Raise from a handler to retry after ``delay`` seconds (counts an attempt)."""

    def __init__(self, delay: float | None = None, reason: str = "retry requested") -> None:
        self.delay = delay
        super().__init__(reason)


class LeaseLost(HarvestError):
    """This attempt no longer holds its leases (paused or cut off past them, or Redis does not
    answer the key check): raised by ``ctx.client()`` / ``ctx.check_lease()`` before a call
    with the key, which is not made. The job retries without using an attempt."""


class GetOrCreateConflict(HarvestError):
    """get_or_create kept colliding with concurrent writers beyond its bounded retries."""


# --- coordination (Redis) -------------------------------------------------------------------


class RateLimited(HarvestError):
    """A rate limit refused a call; ``retry_after`` seconds is when one more would be admitted."""

    def __init__(self, retry_after: float, name: str | None = None) -> None:
        self.retry_after = retry_after
        self.name = name
        which = f"rate limit {name!r}" if name else "rate limit"
        super().__init__(f"{which} reached; retry after {retry_after:.3f}s")


class LockNotAcquired(HarvestError, TimeoutError):
    """Another owner held the lock for the whole timeout."""

    def __init__(self, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout
        super().__init__(f"lock {name!r} is held by another owner (waited {timeout:g}s)")


class SemaphoreBusy(HarvestError, TimeoutError):
    """No permit of the semaphore could be taken within the timeout."""

    def __init__(self, name: str, timeout: float) -> None:
        self.name = name
        self.timeout = timeout
        super().__init__(f"semaphore {name!r}: no permit free within {timeout:g}s")


class KeyNotFound(HarvestError, LookupError):
    """No API key matches the id or (pool, name) given."""

    def __init__(self, key: int | tuple[str, str]) -> None:
        self.key = key
        if isinstance(key, tuple):
            super().__init__(f"no API key {key[1]!r} in pool {key[0]!r}")
        else:
            super().__init__(f"no API key with id {key}")


class NoKeyAvailable(HarvestError):
    """No key of the pool could be leased in time; ``retry_after`` is the pool's own estimate."""

    def __init__(self, pool: str, retry_after: float) -> None:
        self.pool = pool
        self.retry_after = retry_after
        super().__init__(f"no key available in pool {pool!r}; retry after {retry_after:.3f}s")


class PoolNotLoaded(HarvestError):
    """Redis holds no state for this key pool (never synced, or Redis lost it): sync it first."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        super().__init__(f"key pool {pool!r} is not loaded in Redis; call KeyPool.sync() first")


class KeyRejected(HarvestError):
    """Raise from a handler when the service refused the leased API key (401/403): the key is
    disabled in the pool and in Postgres, and the job retries on another key without using up
    an attempt. The message never contains the key."""

    def __init__(self, reason: str = "the service rejected the API key") -> None:
        self.reason = reason
        super().__init__(reason)


class InvalidFilter(HarvestError, ValueError):
    """A filter or bound given to a listing or a bulk action cannot be used (the dashboard and
    its API answer 422); nothing was read or changed."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"invalid {field}: {reason}")
