"""Lease renewal: one round renews every job lease a process holds in one statement, and its
key leases in one round trip; the decisions (what to renew, what a missing row means) are in
:mod:`harvest.execution.tracking`. :class:`HeartbeatThread` is the blocking form (a daemon
thread, started lazily after fork); the asyncio runtime has its own task over the same calls.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from harvest.execution import sql, tracking
from harvest.execution.tracking import Tracked

if TYPE_CHECKING:
    from harvest.execution.sync_shell import SyncShell

log = logging.getLogger("harvest.heartbeat")


class HeartbeatThread:
    def __init__(self, shell: SyncShell) -> None:
        self.shell = shell
        self.ttl = shell.plan.lease_ttl
        self.interval = shell.app.settings.heartbeat_interval
        self._jobs: dict[int, Tracked] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wedged = False

    def track(self, job: Tracked) -> None:
        with self._lock:
            self._jobs[job.job_id] = job
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._run, name="harvest-heartbeat", daemon=True
                )
                self._thread.start()

    def untrack(self, job: Tracked) -> None:
        with self._lock:
            if self._jobs.get(job.job_id) is job:
                del self._jobs[job.job_id]

    def tracked(self) -> list[Tracked]:
        with self._lock:
            return list(self._jobs.values())

    def stop(self) -> None:
        self._stop.set()

    def beat(self) -> None:
        """One renewal round (the thread calls it; tests may too)."""
        plan = tracking.renewal(self.tracked(), time.monotonic())
        if plan.wedged:
            if not self._wedged:
                log.error(
                    "job %s is stuck past its time limit where nothing can stop it; this "
                    "process stops renewing its leases so that rescue takes its jobs back",
                    plan.wedged[0].job_id,
                )
            self._wedged = True
            return
        self._wedged = False
        if not plan.jobs:
            return
        try:
            self._renew_keys(plan.keys)  # first, and whatever Postgres does: see renewal()
        finally:
            pairs = [(t.job_id, t.token) for t in plan.jobs]
            held = self.shell.db(sql.heartbeat(pairs, ttl=self.ttl))
            tracking.settle(plan.jobs, held)

    def _renew_keys(self, jobs: list[Tracked]) -> None:
        pairs = [(t, t.key_lease) for t in jobs if not t.lost and t.key_lease is not None]
        if not pairs:
            return
        sent_at = time.monotonic()
        renewed = self.shell.gate.heartbeat_many([lease for _, lease in pairs])
        tracking.keys_renewed(pairs, renewed, sent_at, self.ttl)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception as exc:
                log.warning("heartbeat round failed: %s", type(exc).__name__)
