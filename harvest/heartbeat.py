"""Lease renewal for running jobs: one daemon thread per process, started lazily (after fork).

Every ``heartbeat_interval`` it extends, in one statement, the leases of the jobs this process
runs; a job whose lease was lost (rescued after a pause) is marked so its outcome is dropped,
and a job someone cancelled gets its ``ctx.cancelled`` set. A job past its time limit (plus a
grace period) stops all renewal in this process (a worker child runs one message at a time, so
it is wedged), and rescue takes its jobs back.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from harvest import store

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Tracked:
    job_id: int
    token: uuid.UUID
    deadline: float  # monotonic; past it, renewal stops
    cancel: threading.Event
    lost: bool = False
    key_lease: Any = None  # the API key lease held for this job, renewed alongside


class Heartbeat:
    def __init__(
        self,
        engine: Engine,
        *,
        ttl: float,
        interval: float,
        renew_key: Callable[[Any], bool] | None = None,
    ) -> None:
        self.engine, self.ttl, self.interval = engine, ttl, interval
        self.renew_key = renew_key
        self._jobs: dict[int, Tracked] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def track(self, job: Tracked) -> None:
        with self._lock:
            self._jobs[job.job_id] = job
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._run, name="harvest-heartbeat", daemon=True
                )
                self._thread.start()

    def untrack(self, job_id: int) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def stop(self) -> None:
        self._stop.set()

    def beat(self) -> None:
        """One renewal round (the thread calls it; tests may too)."""
        now = time.monotonic()
        with self._lock:
            jobs = list(self._jobs.values())
        if any(j.deadline <= now for j in jobs):
            # A handler is stuck past its time limit where no signal reached it: this process
            # is wedged, so stop renewing everything it holds and let rescue take it back.
            log.error("a job is stuck past its time limit; leases of this process left to expire")
            return
        due = [j for j in jobs if not j.lost]
        if not due:
            return
        with self.engine.begin() as conn:
            held = store.heartbeat(conn, [(j.job_id, j.token) for j in due], ttl=self.ttl)
        for job in due:
            if job.job_id not in held:
                job.lost = True
                log.warning(
                    "job %s: lease lost while running; its outcome will be dropped", job.job_id
                )
            elif held[job.job_id]:
                job.cancel.set()
        for job in due:
            if job.key_lease is not None and self.renew_key is not None and not job.lost:
                self.renew_key(job.key_lease)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception as exc:
                log.warning("heartbeat round failed: %s", type(exc).__name__)
