"""What an attempt's outcome is: pure decisions, no I/O, the same for sync and async handlers.

Given what the handler did (returned a value, raised, ran out of time, was cancelled), these
functions say how the attempt ends (succeeded, retried after a delay, failed, cancelled, handed
back), what its fenced write carries, and what the key that served it should do (rest after a
429, be disabled after a 401). The shells in :mod:`harvest.execution` carry the outcome out.
"""

from __future__ import annotations

import inspect
import json
import re
import traceback as tb
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harvest.errors import (
    JobTimeout,
    KeyRejected,
    LeaseLost,
    PermanentError,
    RateLimited,
    Retry,
    UnknownJob,
)
from harvest.models import JobStatus
from harvest.redact import mask_secret, redact_text
from harvest.retry import RetryPolicy, should_retry

if TYPE_CHECKING:
    from harvest.app import JobSpec
    from harvest.jobs import Started

MAX_ERROR_CHARS = 4000
MAX_TRACEBACK_CHARS = 20000
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")  # an escaped NUL, not an escaped backslash


@dataclass(frozen=True, slots=True)
class KeyAction:
    """What the API key that served the attempt should do: rest ``cooldown`` seconds (the
    service answered 429), or be disabled (it answered 401/403)."""

    cooldown: float | None = None
    disable: bool = False


@dataclass(frozen=True, slots=True)
class Outcome:
    """How an attempt ends: the values of its one fenced write, and what happened."""

    status: JobStatus
    result_json: str | None = None
    error: str | None = None
    traceback: str | None = None
    retry_delay: float = 0.0
    refund_attempt: bool = False  # the attempt does not count (not the job's fault)
    key_action: KeyAction | None = None
    error_type: str | None = None  # the exception's class name, for logs and events

    @property
    def retrying(self) -> bool:
        return self.status is JobStatus.PENDING


def scrub(text: str, secret: str | None) -> str:
    """Redact URL passwords, and the leased key wherever a handler let it into the text."""
    text = redact_text(text)
    if not secret:
        return text
    text = text.replace(secret, mask_secret(secret))
    escaped = json.dumps(secret)[1:-1]  # the key as it appears inside a JSON string
    return text.replace(escaped, mask_secret(secret)) if escaped != secret else text


def _lone_surrogate(result: Any) -> bool:
    """True when a string of the result is not valid Unicode (json escapes a lone surrogate
    as ``\\udcff``, which jsonb refuses; a pair for one character is fine)."""
    try:
        json.dumps(result, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def succeeded(result: Any, *, secret: str | None = None, cancelled: bool = False) -> Outcome:
    """The handler returned ``result``. It must encode as JSON (else the job fails: a
    TypeError is not retried); the leased key is masked wherever it appears in it."""
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if callable(close):
            close()  # a never-awaited coroutine would warn at garbage collection
        problem = "the handler returned a coroutine: declare it `async def` (harvest awaits it)"
        return _final(TypeError(problem), secret)
    try:
        result_json = json.dumps(result, allow_nan=False) if result is not None else None
    except (TypeError, ValueError) as exc:
        return _final(TypeError(f"the handler's result is not JSON: {exc}"), secret)
    if result_json is not None and _JSON_NUL.search(result_json):
        return _final(
            TypeError(
                "the handler's result holds a NUL character (\\u0000), which "
                "Postgres jsonb cannot store"
            ),
            secret,
        )
    if result_json is not None and "\\ud" in result_json and _lone_surrogate(result):
        return _final(
            TypeError(
                "the handler's result holds a lone surrogate (not valid Unicode), which "
                "Postgres cannot store"
            ),
            secret,
        )
    if result_json is not None and secret:
        result_json = scrub(result_json, secret)
    if cancelled:
        return Outcome(JobStatus.CANCELLED, result_json=result_json, error="cancelled")
    return Outcome(JobStatus.SUCCEEDED, result_json=result_json)


def raised(
    job: Started,
    spec: JobSpec | None,
    exc: BaseException,
    *,
    secret: str | None = None,
    cancelled: bool = False,
    keyed: bool = False,
    retry_base: float = 1.0,
) -> Outcome:
    """The handler raised ``exc`` (a JobTimeout when it ran out of time).

    ``cancelled``: someone asked to cancel the job (it ends cancelled, whatever it raised).
    ``keyed``: the attempt held an API key, so a RateLimited / KeyRejected is the key's fault:
    the key rests or is disabled and the job retries on another key without using an attempt;
    so does a LeaseLost (the key check before a call found the key lease gone, or could not
    ask Redis: no call was made with it), after ``retry_base`` seconds.
    Otherwise ``spec.retry_on`` decides (PermanentError and TypeError never retry; ``Retry``
    always does, after its own delay if it gives one), while attempts remain."""
    error, trace = _texts(exc, secret)
    kind = type(exc).__name__
    if cancelled:
        return Outcome(JobStatus.CANCELLED, error=error, traceback=trace, error_type=kind)
    if keyed and isinstance(exc, RateLimited | KeyRejected | LeaseLost):
        action, delay = _key_fault(exc, retry_base)
        return Outcome(
            JobStatus.PENDING,
            error=error,
            traceback=trace,
            retry_delay=delay,
            refund_attempt=True,
            key_action=action,
            error_type=kind,
        )
    if retryable(spec, exc) and should_retry(job.attempt, job.max_attempts):
        return Outcome(
            JobStatus.PENDING,
            error=error,
            traceback=trace,
            retry_delay=retry_delay(job, spec, exc, retry_base=retry_base),
            error_type=kind,
        )
    return Outcome(JobStatus.FAILED, error=error, traceback=trace, error_type=kind)


def _key_fault(
    exc: RateLimited | KeyRejected | LeaseLost, retry_base: float
) -> tuple[KeyAction | None, float]:
    """What a key's fault does to the key, and how soon the job retries: a 429 rests the key
    for its Retry-After; a refusal disables it (retry at once, on another key); a lost key
    lease leaves the key alone (retry after ``retry_base``)."""
    if isinstance(exc, RateLimited):
        return KeyAction(cooldown=max(exc.retry_after, 0.001)), exc.retry_after
    if isinstance(exc, KeyRejected):
        return KeyAction(disable=True), 0.0
    return None, retry_base


def retryable(spec: JobSpec | None, exc: BaseException) -> bool:
    """Whether ``exc`` from ``spec``'s handler retries (while attempts remain)."""
    if isinstance(exc, Retry) or spec is None:
        return True
    return isinstance(exc, spec.retry_on) and not isinstance(exc, PermanentError | TypeError)


def retry_delay(
    job: Started, spec: JobSpec | None, exc: BaseException, *, retry_base: float = 1.0
) -> float:
    """Seconds until the retry after ``job``'s failed attempt: ``Retry(delay=...)`` if the
    handler said so, else the job's backoff policy (with jitter)."""
    if isinstance(exc, Retry) and exc.delay is not None:
        return exc.delay
    policy = spec.retry if spec is not None else RetryPolicy(base=retry_base)
    return policy.delay(job.attempt)


def timed_out(
    job: Started, spec: JobSpec | None, *, secret: str | None = None, retry_base: float = 1.0
) -> Outcome:
    """The attempt ran past its time limit: JobTimeout, through the retry policy."""
    timeout = job.timeout or (spec.timeout if spec is not None else 0.0)
    return raised(job, spec, JobTimeout(timeout), secret=secret, retry_base=retry_base)


def unknown(job: Started, known: list[str]) -> BaseException:
    """The error of a job whose name this worker does not know."""
    return UnknownJob(job.name, known)


def unknown_job(exc: UnknownJob, secret: str | None = None) -> Outcome:
    """No worker knew the job's name within its grace (a deploy that never came): failed."""
    return _final(exc, secret)


def cancelled_before_start() -> Outcome:
    return Outcome(JobStatus.CANCELLED, error="cancelled before it started")


def handed_back(reason: str) -> Outcome:
    """The worker stopped before the attempt ended (warm shutdown past its grace): the job goes
    back to pending at once, the attempt not counted."""
    error = f"handed back: {reason}"
    return Outcome(JobStatus.PENDING, error=error, refund_attempt=True, error_type="HandedBack")


def _final(exc: BaseException, secret: str | None) -> Outcome:
    error, trace = _texts(exc, secret)
    return Outcome(JobStatus.FAILED, error=error, traceback=trace, error_type=type(exc).__name__)


def _texts(exc: BaseException, secret: str | None) -> tuple[str, str]:
    """The error line and traceback as stored: the key masked, NUL (which Postgres text cannot
    hold) shown as \\x00, bounded in size."""
    error = scrub(f"{type(exc).__name__}: {exc}", secret).replace("\x00", "\\x00")
    trace = scrub("".join(tb.format_exception(exc)), secret).replace("\x00", "\\x00")
    return error[:MAX_ERROR_CHARS], trace[-MAX_TRACEBACK_CHARS:]
