"""What the dispatcher reads of key pools' capacity (:func:`harvest.dispatcher.pool_budgets`):
each pool's live key state from Redis, read again at every round only while it matters."""

from __future__ import annotations

import logging
import math
import time
import weakref
from typing import TYPE_CHECKING

from harvest import keystore
from harvest.coordination.key_pool import KeyPool, KeyState
from harvest.errors import PoolNotLoaded
from harvest.outage import REDIS, Outages, service_of

if TYPE_CHECKING:
    from harvest.app import Harvest

log = logging.getLogger("harvest.dispatcher")


class Ample:
    """The keys' state of each pool whose budget could not bind a claim (at least a claim
    batch), kept for ``FOR`` seconds from its read: while a pool has that much room, the claim
    runs without its budget anyway (:func:`harvest.store.claim_due`), and the dispatcher need
    not read every key of it again at every 20 ms round (measured: a fifth of the schedule
    process's CPU in the key pool gate benchmark). The jobs in flight are still counted every
    round, so the jobs sent meanwhile come off the budget; a pool whose budget could bind is
    read every round, as a full pool must be."""

    FOR = 0.2

    def __init__(self) -> None:
        self._kept: dict[str, tuple[float, list[KeyState]]] = {}

    def states(self, pool: str) -> list[KeyState] | None:
        read_at, states = self._kept.get(pool, (-math.inf, []))
        return states if time.monotonic() - read_at < self.FOR else None

    def keep(self, pool: str, states: list[KeyState], *, ample: bool) -> None:
        if not ample or not states:
            self._kept.pop(pool, None)
        elif self.states(pool) is None:  # none kept, or too old: this read is new
            self._kept[pool] = (time.monotonic(), states)  # its read time stays while reused


AMPLE: weakref.WeakKeyDictionary[Harvest, Ample] = weakref.WeakKeyDictionary()
_outages = Outages(log, "capacity reads")
# Each app's KeyPool of each pool the dispatcher reads (made once: its scripts are objects).
_POOLS: weakref.WeakKeyDictionary[Harvest, dict[str, KeyPool]] = weakref.WeakKeyDictionary()


def pool_states(app: Harvest, pool: str) -> list[KeyState]:
    """The live state of one pool's keys ([] when it cannot be read: no capacity). A pool
    Redis lost (a restart, a flush) is loaded again from Postgres first. Redis away is logged
    once when it goes and once when it is back (it is read every round)."""
    key_pool = _POOLS.setdefault(app, {}).get(pool)
    if key_pool is None:
        key_pool = _POOLS[app][pool] = KeyPool(app.redis, pool)
    try:
        try:
            states = key_pool.snapshot()
        except PoolNotLoaded:
            keystore.ensure_pool_loaded(app.engine, app.redis, pool)
            states = key_pool.snapshot()
    except Exception as exc:
        if service_of(exc) == REDIS:
            _outages.failed(REDIS, exc, "reading key pool capacity: their jobs wait")
        else:
            log.warning(
                "key pool %r capacity unknown (%s); dispatching none of its jobs",
                pool,
                type(exc).__name__,
            )
        return []
    _outages.answered(REDIS)
    return states
