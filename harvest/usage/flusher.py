"""The thread that writes a process's tally to Postgres every few seconds."""

from __future__ import annotations

import logging
import threading

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from harvest.usage import rows
from harvest.usage.tally import Tally

log = logging.getLogger("harvest.usage")


class Flusher:
    """Every ``interval`` seconds, the tally's rows in one transaction (two statements). A flush
    that fails puts its rows back for the next one; :meth:`stop` flushes what is left."""

    def __init__(self, engine: Engine, tally: Tally, *, interval: float) -> None:
        self.engine, self.tally, self.interval = engine, tally, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one flush at a time (the thread, stop, tests)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="harvest-usage", daemon=True)
            self._thread.start()

    def flush(self) -> int:
        """Write what was counted so far; returns the rows written (0 when it failed)."""
        with self._lock:
            taken = self.tally.take()
            if not taken:
                return 0
            try:
                with self.engine.begin() as conn:
                    rows.add(conn, taken)
            except SQLAlchemyError as exc:
                self.tally.merge(taken)
                log.warning("usage not written (%s): kept for the next flush", type(exc).__name__)
                return 0
            return len(taken)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.flush()
            except Exception as exc:  # the thread must outlive any one failure
                log.warning("usage flush failed: %s", type(exc).__name__)
