"""How a job of an execution message is taken by the asyncio shell, before
:func:`~harvest.execution.core.attempt` decides the rest.

Any job may be held (its dispatch lease extended, a duplicate delivery stopped) and then
started once the gate lets it: two row writes. Where nothing can stand between the two, the
hold is the start, one fenced write: a job that needs nothing of the gate
(:func:`starts_at_hold`), and a job of one key pool that finds its key at once
(:func:`key_first`). Pure decisions, as the core's; the shell does the I/O.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from harvest.coordination import fallback
from harvest.coordination.key_state import Lease
from harvest.execution import away, sql
from harvest.execution import effects as fx
from harvest.execution.core import Plan, not_started
from harvest.jobs import Started

if TYPE_CHECKING:
    from harvest.app import JobSpec


def starts_at_hold(spec: JobSpec | None) -> bool:
    """Whether a delivered job is held and started in one fenced write: it needs nothing of
    the gate (no rate limit, no key pool), so nothing can make it wait between the two, and
    a hold (the dispatch lease extended) then a start (attempt counted) would be two row
    writes where one does. An unknown job is held (it is deferred, never started here)."""
    return spec is not None and spec.rate_limit is None and not spec.pool


def leases_first(spec: JobSpec | None) -> bool:
    """Whether a delivered job tries its key before its hold (:func:`key_first`): one key pool,
    no rate limit and no token cost, so neither its payload nor a permit is needed first."""
    return (
        spec is not None
        and spec.rate_limit is None
        and spec.cost is None
        and len(fallback.pools(spec.pool)) == 1
    )


@dataclass(frozen=True, slots=True)
class Keyed:
    """A job held and started in one write with its key leased first (:func:`key_first`)."""

    job: Started
    lease: Lease
    asked_at: float  # monotonic: when the lease was asked for


def leases_from(spec: JobSpec | None, pool: str) -> bool:
    """Whether a job :func:`leases_first`, from ``pool``."""
    return spec is not None and leases_first(spec) and fallback.pools(spec.pool)[0] == pool


def lease_first(
    job_id: int, spec: JobSpec, plan: Plan
) -> Generator[fx.Effect, Any, tuple[Lease, float] | None]:
    """One lease try for a job that :func:`leases_first`, before its hold: the lease and when it
    was asked for (monotonic), or None (no key now, no such pool in Redis, Redis does not
    answer: the job is held and goes through the gate as any job, :func:`attempt`)."""
    asked_at = yield fx.Clock()
    try:
        lease = yield fx.LeaseKey(fallback.pools(spec.pool)[0], f"{plan.worker}:{job_id}", 0)
    except away.REDIS_AWAY:
        return None  # the gate meets it again and steps the job back (``core.attempt``)
    if not isinstance(lease, Lease):
        return None
    away.answered()  # Redis answers (again): an outage's end is logged
    return lease, asked_at


def key_first(
    pair: sql.Pair, spec: JobSpec, plan: Plan
) -> Generator[fx.Effect, Any, Keyed | tuple[str, ...] | None]:
    """A job that :func:`leases_first`: one lease try (:func:`lease_first`), then, with a key,
    its hold is its start (one fenced write, as for a job that needs no key). A duplicate or
    cancelled delivery gives the key back and ends here (its counts). No key now: None, and it
    is held and goes through the gate as any job (:func:`attempt`)."""
    leased = yield from lease_first(pair[0], spec, plan)
    if leased is None:
        return None
    lease, asked_at = leased
    try:
        answer = yield fx.Start(*pair)
    except Exception:  # the write failed: the key goes back now, not when its lease expires
        yield fx.ReleaseKey(lease, used=0)
        raise
    if isinstance(answer, Started):
        return Keyed(answer, lease, asked_at)
    yield fx.ReleaseKey(lease, used=0)
    return (yield from not_started(answer))
