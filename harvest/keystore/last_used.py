"""Write-behind of key-use times: many calls, one statement per window."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

from sqlalchemy import Engine

from harvest.db import translate_errors
from harvest.keystore.rows import touch_last_used


class LastUsedBuffer:
    """Collects key-use times in memory and writes them in one statement per window, instead of
    one UPDATE per call. Thread-safe; keeps at most one time per key (the latest)."""

    def __init__(
        self,
        flush_every: float = 5.0,
        *,
        max_pending: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """
        :param flush_every: seconds between writes.
        :param max_pending: a flush is due at once when this many keys wait.
        :param clock: monotonic seconds (tests pass their own).
        """
        if not flush_every > 0:
            raise ValueError(f"invalid flush_every {flush_every!r}: must be > 0 seconds")
        if max_pending < 1:
            raise ValueError(f"invalid max_pending {max_pending!r}: must be >= 1")
        self.flush_every = flush_every
        self.max_pending = max_pending
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[int, datetime] = {}
        self._last_flush = clock()

    def record(self, key_id: int, at: datetime | None = None) -> None:
        """Note that ``key_id`` was used at ``at`` (default: now, UTC)."""
        with self._lock:
            self._merge_locked({key_id: at or datetime.now(UTC)})

    def pending(self) -> int:
        """How many keys wait to be written."""
        with self._lock:
            return len(self._pending)

    def due(self) -> bool:
        """True when there is something to write and the window has passed (or it is full)."""
        with self._lock:
            return self._due_locked()

    def flush(self, engine: Engine, *, force: bool = False) -> int:
        """Write the pending times in one statement if due (or ``force``). Returns how many keys
        were written. When the write fails the times are kept for the next flush."""
        with self._lock:
            if not self._pending or not (force or self._due_locked()):
                return 0
            batch, self._pending = self._pending, {}
            self._last_flush = self._clock()
        try:
            with translate_errors(), engine.begin() as conn:
                return touch_last_used(conn, batch)
        except Exception:
            with self._lock:
                self._merge_locked(batch)
            raise

    def _due_locked(self) -> bool:
        if not self._pending:
            return False
        full = len(self._pending) >= self.max_pending
        return full or self._clock() - self._last_flush >= self.flush_every

    def _merge_locked(self, times: Mapping[int, datetime]) -> None:
        for key_id, at in times.items():
            known = self._pending.get(key_id)
            self._pending[key_id] = at if known is None or at > known else known
