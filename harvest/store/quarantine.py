"""Rows harvest cannot read (written around the door): the readable range of times, and the
statements that fail such rows with their reason."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, text

from harvest.store.figures import bump

# The logger keeps the name it had before the split (one module, harvest.store).
log = logging.getLogger("harvest.store")


# --- rows harvest cannot read ----------------------------------------------------------------

# The instants Python can hold in any session time zone (harvest.validation.RUN_AT_MIN/MAX):
# a row written around the door (by hand, another client) may hold any timestamptz.
READABLE_FROM = "CAST('0001-01-02 00:00:00+00' AS timestamptz)"
READABLE_TO = "CAST('9999-12-30 00:00:00+00' AS timestamptz)"
QUARANTINED = "quarantined"
_OUT_OF_RANGE = "is outside the times harvest can read (years 1 to 9999)"

_QUARANTINE_PENDING = text(
    f"""
    UPDATE harvest_jobs
    SET status = 'failed', finished_at = now(), lease_token = NULL, lease_expires_at = NULL,
        last_error = 'quarantined: run_at ' || run_at::text || ' {_OUT_OF_RANGE}'
    WHERE status = 'pending' AND (run_at < {READABLE_FROM} OR run_at > {READABLE_TO})
    RETURNING id, name, last_error
    """
)
_QUARANTINE = text(
    """
    UPDATE harvest_jobs AS j
    SET status = 'failed', finished_at = now(), lease_token = NULL, lease_expires_at = NULL,
        last_error = q.reason
    FROM unnest(CAST(:ids AS bigint[]), CAST(:reasons AS text[])) AS q(id, reason)
    WHERE j.id = q.id AND j.status IN ('pending', 'dispatched', 'running')
    RETURNING j.id, j.name, j.last_error
    """
)


@dataclass(frozen=True, slots=True)
class Quarantined:
    id: int
    name: str
    reason: str


def _quarantined(conn: Connection, rows: Iterable[Any]) -> list[Quarantined]:
    found = [Quarantined(int(r.id), str(r.name), str(r.last_error)) for r in rows]
    if found:
        bump(conn, QUARANTINED, len(found))
        for q in found:  # once: a failed row is never quarantined again
            log.error("job %d (%s) quarantined (failed): %s", q.id, q.name, q.reason)
    return found


def quarantine_pending(conn: Connection) -> list[Quarantined]:
    """Fail the pending rows whose ``run_at`` Python cannot read (index
    ``harvest_jobs_age_idx``: two short range scans); the claim skips them meanwhile."""
    return _quarantined(conn, conn.execute(_QUARANTINE_PENDING))


def quarantine(conn: Connection, reasons: Mapping[int, str]) -> list[Quarantined]:
    """Fail the given unfinished jobs, each with its reason (rows already ended are left)."""
    if not reasons:
        return []
    params = {"ids": list(reasons), "reasons": [f"quarantined: {r}" for r in reasons.values()]}
    return _quarantined(conn, conn.execute(_QUARANTINE, params))
