"""One execution process: takes messages, runs their jobs, reports what it runs.

``harvest.execute`` (the Celery task) calls :meth:`Executor.execute` with a message's
``[[job_id, token, name], ...]``. Jobs of ``async def`` handlers go to the process's event loop
(:class:`~harvest.execution.loop.AsyncRuntime`, a thread started after fork) and run there
many at once, up to ``HARVEST_ASYNC_CONCURRENCY``: the task returns as soon as they are handed
over (the loop holds them), so Celery's slot is free for the next message, and it waits only
while the loop is full. Jobs of sync handlers run
in the calling thread, one after another (a prefork child, ``-P threads``, ``-P gevent``);
where a process runs several threads, their writes are grouped
(:mod:`~harvest.execution.thread_writer`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from harvest.execution import core, registry, sql
from harvest.execution.loop import AsyncRuntime
from harvest.execution.messages import Item, parse_message
from harvest.execution.sync_shell import SyncShell
from harvest.usage.flusher import Flusher

if TYPE_CHECKING:
    from harvest.app import Harvest

log = logging.getLogger("harvest.runner")

GROUPED_POOLS = ("threads", "gevent")  # where one process runs sync jobs in several threads
COUNTS = ("started", "suppressed", "lost", "deferred")
PRESENCE_EVERY = 2.0  # seconds between registry beats; a process is gone 3 beats after its last


class Executor:
    """Everything one execution process needs to run jobs (made after fork, once)."""

    def __init__(
        self,
        app: Harvest,
        *,
        pool: str = "prefork",
        concurrency: int = 1,
        queues: Sequence[str] = (),
    ) -> None:
        settings = app.settings
        self.app = app
        self.pool, self.concurrency, self.queues = pool, concurrency, tuple(queues)
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.plan = core.Plan(
            worker=self.worker,
            key_wait=settings.key_wait,
            unknown_job_grace=settings.unknown_job_grace,
            retry_base=settings.retry_base,
            lease_ttl=settings.lease_ttl,
            known=tuple(sorted(app.jobs)),
        )
        lingers = (settings.write_linger_ms / 1000, settings.settle_linger_ms / 1000)
        # several sync jobs in flight: group their writes, as the event loop does its jobs'
        grouped = pool in GROUPED_POOLS and concurrency > 1
        self.sync = SyncShell(app, self.plan, lingers=lingers if grouped else None)
        self.usage = Flusher(app.engine, self.sync.usage, interval=settings.usage_flush_interval)
        self.async_concurrency = settings.async_concurrency
        self._aio: AsyncRuntime | None = None
        self._aio_lock = threading.Lock()
        self._started_at = time.time()
        self._presence: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def heartbeat(self) -> Any:
        return self.sync.heartbeat

    @property
    def gate(self) -> Any:
        return self.sync.gate

    def aio(self) -> AsyncRuntime:
        with self._aio_lock:
            if self._aio is None:
                self._aio = AsyncRuntime(self.app, self.plan, self.sync, self.async_concurrency)
            return self._aio

    def has_async_jobs(self) -> bool:
        return any(spec.is_async for spec in self.app.jobs.values())

    def execute(self, body: Any, *, wait: bool = True) -> dict[str, int]:
        """Run a message's jobs. ``wait``: until every one has ended (in-process use and
        tests); the Celery task passes False, so async jobs run on after it returns."""
        self.start_presence()
        counts: Counter[str] = Counter(dict.fromkeys(COUNTS, 0))
        try:
            items = parse_message(body)
        except (ValueError, TypeError) as exc:
            log.error("dropped a malformed execution message: %s", exc)
            self.sync.db(sql.bump({core.MALFORMED: 1}))
            return dict(counts)
        first: list[Item] = []  # async jobs, named in the message
        rest: list[Item] = []
        for item in items:
            (first if item.name is not None and self._is_async(item.name) else rest).append(item)
        if first:
            counts.update(self._run_async(first, wait=wait))
        if rest:
            counts.update(self._run_rest(rest, wait=wait))
        if any(counts[k] for k in ("started", "deferred", "accepted")):
            self.app.nudge()
        return dict(counts)

    def _run_async(self, items: Sequence[Item], *, wait: bool) -> Counter[str]:
        """Async jobs: hand them to the loop as it has room for them, never more than its
        ``HARVEST_ASYNC_CONCURRENCY`` at once; the loop holds them (one statement for every
        message of the moment). Celery's slot is free again once the last is handed over.
        Jobs not handed over in time stay in the message's dispatch lease (rescue)."""
        aio = self.aio()
        deadline = time.monotonic() + self._hold_timeout()
        parts = []
        rest = list(items)
        while rest:
            taken = aio.admission.take_some(len(rest), max(0.0, deadline - time.monotonic()))
            if not taken:
                raise TimeoutError(f"the event loop had no room for {len(rest)} jobs in time")
            parts.append(aio.start(rest[:taken], wait=wait))
            rest = rest[taken:]
        if not wait:  # the loop holds them: this thread does not wait for it
            return Counter(accepted=len(items))
        counts: Counter[str] = Counter()
        for part in parts:
            counts.update(part.result())
        return counts

    def _run_rest(self, items: Sequence[Item], *, wait: bool) -> Counter[str]:
        jobs, counts = self.sync.take(items)
        late = [(pair, h) for pair, h in jobs if isinstance(h, sql.Held) and self._is_async(h.name)]
        if late:
            aio = self.aio()
            aio.admission.take(len(late), float("inf"))
            counts.update(aio.submit(late, wait=wait))
        counts.update(self.sync.run_held([j for j in jobs if j not in late]))
        return counts

    def _is_async(self, name: str) -> bool:
        spec = self.app.jobs.get(name)
        return spec is not None and spec.is_async

    def _hold_timeout(self) -> float:
        """How long a message may wait for room on the loop: well inside its dispatch lease."""
        return max(1.0, self.app.settings.dispatch_ttl / 2)

    # --- who this process is --------------------------------------------------------------

    def info(self) -> registry.WorkerInfo:
        running = [t.job_id for t in self.sync.heartbeat.tracked()]
        in_flight = len(running)
        if self._aio is not None and self._aio.shell is not None:
            running += list(self._aio.shell.tracked)
            in_flight = len(running)
        hostname, pid = self.worker.rsplit(":", 1)
        return registry.WorkerInfo(
            id=self.worker,
            hostname=hostname,
            pid=int(pid),
            queues=self.queues,
            pool=self.pool,
            concurrency=1 if self.pool == "prefork" else self.concurrency,
            async_concurrency=self.async_concurrency if self.has_async_jobs() else 0,
            started_at=self._started_at,
            in_flight=in_flight,
            running=tuple(running[: registry.MAX_RUNNING_LISTED]),
        )

    def start_presence(self) -> None:
        self.usage.start()
        if self._presence is None:
            self._presence = threading.Thread(
                target=self._present, name="harvest-presence", daemon=True
            )
            self._presence.start()

    def _present(self) -> None:
        while not self._stopping.is_set():
            try:
                registry.beat(self.app.redis, self.info(), ttl=PRESENCE_EVERY * 3)
            except Exception as exc:
                log.debug("worker registry not updated (%s)", type(exc).__name__)
            self._stopping.wait(PRESENCE_EVERY)

    def shutdown(self, grace: float | None = None) -> None:
        """Warm shutdown of this process's jobs (see :meth:`AsyncRuntime.shutdown`)."""
        grace = self.app.settings.shutdown_grace if grace is None else grace
        self._stopping.set()
        self.sync.heartbeat.stop()
        if self.sync.parked is not None:
            self.sync.parked.drain()  # a key kept for a next message: back to Redis now
        if self._aio is not None:
            running = self._aio.admission.in_use
            finished, handed_back = self._aio.shutdown(grace)
            if running:
                log.warning(
                    "warm shutdown: %d async jobs were in flight; %d finished, %d handed back "
                    "(pending again, the attempt not counted)",
                    running,
                    finished,
                    handed_back,
                )
        self.usage.stop()  # what the jobs that ended counted, written before we leave
        if self._presence is not None:
            self._presence.join(5.0)  # its last beat lands before we leave, not after
        try:
            registry.leave(self.app.redis, self.worker)
        except Exception as exc:
            log.debug("worker registry not cleared (%s)", type(exc).__name__)
