"""Which of a message's sync jobs start together (:mod:`harvest.execution.run_ahead`): each
job name's recent run time in the process, and the rule a window of short jobs keeps: their run
times, known, add up to at most the write linger."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from harvest.coordination.key_state import Lease
from harvest.execution import delivery
from harvest.execution.messages import Item

if TYPE_CHECKING:
    from harvest.app import JobSpec

MAX_WINDOW = 64  # jobs started together at most


class RunTimes:
    """Each job name's recent handler run time in this process, seconds: the third quartile of
    its last :data:`KEPT` runs. A few slow runs among fast ones (the machine busy for a moment)
    do not stop a name's jobs from sharing writes; a name whose jobs turn slow stops within a
    quarter of that many runs (and a window's ends never wait past their linger for it:
    :meth:`Message._may_wait` is asked again before each job's turn)."""

    KEPT = 16

    def __init__(self) -> None:
        self._runs: dict[str, collections.deque[float]] = {}
        self._of: dict[str, float] = {}

    def saw(self, name: str, seconds: float) -> None:
        runs = self._runs.get(name)
        if runs is None:
            runs = self._runs[name] = collections.deque(maxlen=self.KEPT)
        runs.append(seconds)
        ordered = sorted(runs)
        self._of[name] = ordered[(3 * len(ordered)) // 4]

    def of(self, name: str) -> float | None:
        return self._of.get(name)


def joins(spent: float | None, ran: float | None, linger: float) -> bool:
    """Whether a job of run time ``ran`` joins a window whose jobs before it run ``spent``
    seconds together: both known, and at most ``linger`` with it (None: not known)."""
    return spent is not None and ran is not None and spent + ran <= linger


def at_hold(
    items: Sequence[Item],
    jobs: Mapping[str, JobSpec],
    run_times: RunTimes,
    linger: float,
    key: Lease | None = None,
) -> int:
    """How many of a message's first jobs are held and started in one write: the first, when
    it needs nothing of the gate (:func:`~harvest.execution.delivery.starts_at_hold`: it
    starts right after its hold anyway), and after it those that also need nothing of the
    gate, of names whose run times in this process are known and add up, with the first's,
    to at most ``linger`` (a window, as :class:`Message` begins one).

    With ``key``, a lease taken for the first job before its hold
    (:func:`~harvest.execution.delivery.leases_first`): the jobs that lease a key of its pool
    and nothing else first, the first of them, and after it, where the key may pass from job to
    job (``plain``), a window of them, lent the key one after another."""
    spent: float | None = 0.0
    ids: set[int] = set()
    for n, item in enumerate(items[: MAX_WINDOW if key is None or key.plain else 1]):
        spec = jobs.get(item.name or "")
        if spec is None or spec.is_async or not _needs_only(spec, key):
            return n
        ran = run_times.of(spec.name)
        if item.job_id in ids or (n and not joins(spent, ran, linger)):
            return n
        spent = None if spent is None or ran is None else spent + ran
        ids.add(item.job_id)
    return min(len(items), MAX_WINDOW if key is None or key.plain else 1)


def _needs_only(spec: JobSpec, key: Lease | None) -> bool:
    """Whether a job needs nothing of the gate (``key`` None) or only a key of ``key``'s pool."""
    if key is None:
        return delivery.starts_at_hold(spec)
    return delivery.leases_from(spec, key.pool)
