"""Batches, the distributed barrier: a group of jobs and, optionally, a callback job enqueued
exactly once when the last of them ends.

The counting lives in Postgres, in the trigger ``harvest_jobs_batch_member`` (alembic 0004):
each member's move into (or out of) a terminal state updates the batch's counters in the same
transaction as the move, under the batch row's lock; the transaction that brings the ended
count to the total sets ``completed_at`` and inserts the callback job. Every path that ends a
job (finish, a start that finds it cancelled, rescue, cancel) is an UPDATE of its status, so
every path is counted, and no poller is involved.

The callback receives ``batch_id``, ``succeeded``, ``failed`` and ``cancelled`` (plus
``on_complete_payload``). A member retried after the batch completed moves the counts (see
:meth:`Harvest.batch`), never the callback: it fires once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from harvest import validation
from harvest.errors import EnqueueError, InvalidOption

if TYPE_CHECKING:
    from harvest.app import JobSpec

CALLBACK_ARGUMENTS = ("batch_id", "succeeded", "failed", "cancelled")


@dataclass(frozen=True, slots=True)
class BatchRef:
    """What ``enqueue_batch`` returns: the batch's id and its members' ids, in order."""

    id: int
    job_ids: list[int]


@dataclass(frozen=True, slots=True)
class Batch:
    """A batch's progress, from its counters (no scan of the members)."""

    id: int
    total: int
    succeeded: int
    failed: int
    cancelled: int
    on_complete: str | None
    callback_job_id: int | None
    created_at: datetime
    completed_at: datetime | None

    @property
    def ended(self) -> int:
        return self.succeeded + self.failed + self.cancelled

    @property
    def pending(self) -> int:
        """Members not ended yet (pending, dispatched or running)."""
        return self.total - self.ended

    @property
    def complete(self) -> bool:
        return self.completed_at is not None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Batch:
        return cls(
            id=row["id"],
            total=row["total"],
            succeeded=row["succeeded"],
            failed=row["failed"],
            cancelled=row["cancelled"],
            on_complete=row["callback_name"],
            callback_job_id=row["callback_job_id"],
            created_at=row["created_at"],
            completed_at=row["completed_at"],
        )


def check_callback(spec: JobSpec, payload: Mapping[str, Any] | None, *, limit: int) -> str:
    """The callback's extra payload as JSON, after checking that the handler takes the counts
    (``batch_id, succeeded, failed, cancelled``) and the extra payload together."""
    if payload is not None and not isinstance(payload, Mapping):
        raise InvalidOption(
            "on_complete_payload", f"must be a JSON object, got {type(payload).__name__}"
        )
    extra = dict(payload or {})
    clash = sorted(set(extra) & set(CALLBACK_ARGUMENTS))
    if clash:
        raise InvalidOption(
            "on_complete_payload", f"must not set {', '.join(clash)} (harvest fills them in)"
        )
    try:
        encoded = validation.encode_payload(extra, limit=limit)
        validation.check_signature(spec.func, {**extra, **dict.fromkeys(CALLBACK_ARGUMENTS, 0)})
    except EnqueueError as exc:
        raise InvalidOption(
            "on_complete",
            f"job {spec.name!r} cannot be the callback: {exc} (it receives "
            f"{', '.join(CALLBACK_ARGUMENTS)} and on_complete_payload as keyword arguments)",
        ) from None
    return encoded
