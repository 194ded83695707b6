"""Time limits for blocking handlers, in whatever thread Celery runs them.

- The main thread (prefork children, ``-P solo``): SIGALRM raises JobTimeout inside the handler.
- A gevent greenlet (``-P gevent``): ``gevent.Timeout`` raises JobTimeout at its next yield.
- Any other thread (``-P threads``): Python cannot stop a thread. A watchdog ends the attempt
  at its deadline instead (JobTimeout through the retry policy, a fenced write), and whatever
  the handler returns later is dropped.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

from harvest.errors import JobTimeout

log = logging.getLogger(__name__)

Mode = str  # "signal" | "gevent" | "watchdog"


def gevent_active() -> bool:
    """True in a process where gevent patched threading (Celery's ``-P gevent``)."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey is not None and monkey.is_module_patched("threading"))


def mode() -> Mode:
    """How a handler in the calling thread can be held to its time limit."""
    if gevent_active():
        return "gevent"
    if threading.current_thread() is threading.main_thread():
        return "signal"
    return "watchdog"


class Watchdog:
    """One thread that calls each registered callback at its deadline unless cancelled first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._pending: set[int] = set()  # handles still in the heap
        self._cancelled: set[int] = set()  # of those, the ones cancelled
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def at(self, deadline: float, callback: Callable[[], None]) -> int:
        """Call ``callback`` at ``deadline`` (monotonic) in the watchdog thread; returns a
        handle for :meth:`cancel`."""
        with self._cond:
            handle = next(self._seq)
            heapq.heappush(self._heap, (deadline, handle, callback))
            self._pending.add(handle)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="harvest-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()
            return handle

    def cancel(self, handle: int) -> None:
        """Its callback is not called, unless it was already (then nothing is kept of it)."""
        with self._cond:
            if handle in self._pending:
                self._cancelled.add(handle)

    def _next(self) -> Callable[[], None] | None:
        with self._cond:
            while True:
                while self._heap and self._heap[0][1] in self._cancelled:
                    handle = heapq.heappop(self._heap)[1]
                    self._cancelled.discard(handle)
                    self._pending.discard(handle)
                if not self._heap:
                    self._cond.wait(60.0)
                    if not self._heap:
                        return None  # idle for a minute: let the thread end
                    continue
                deadline, _, callback = self._heap[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    self._pending.discard(heapq.heappop(self._heap)[1])
                    return callback
                self._cond.wait(left)

    def _run(self) -> None:
        while (callback := self._next()) is not None:
            try:
                callback()
            except Exception:
                log.exception("a job's deadline action failed")


@contextlib.contextmanager
def limit(
    seconds: float, how: Mode, watchdog: Watchdog, on_deadline: Callable[[], None]
) -> Iterator[None]:
    """Hold the ``with`` block to ``seconds``, the way ``how`` allows."""
    if how == "signal":
        with _alarm(seconds):
            yield
    elif how == "gevent":
        import gevent

        with gevent.Timeout(seconds, JobTimeout(seconds)):
            yield
    else:
        handle = watchdog.at(time.monotonic() + seconds, on_deadline)
        try:
            yield
        finally:
            watchdog.cancel(handle)


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def expired(signum: int, frame: FrameType | None) -> None:
        raise JobTimeout(seconds)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
