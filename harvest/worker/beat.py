"""Beat with leader election: run two beats for availability, only the leader sends.

Every tick first renews (or takes) leadership in Redis (a token-owned lock with a TTL and a
fencing number). A beat that is not the leader sends nothing and checks again soon; a leader
that was paused past its TTL finds the lock taken and stops sending. If Redis cannot be
reached the beat keeps sending: every task beat sends (dispatch, rescue, schedules) is safe to
run twice, so availability wins there, and exactness lives in Postgres.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery.beat import PersistentScheduler

from harvest.coordination.lock import LeaderElector
from harvest.outage import BROKER, REDIS, Outages, service_of
from harvest.settings import load_settings

log = logging.getLogger(__name__)

ELECTION = "beat"


class LeaderScheduler(PersistentScheduler):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        settings = load_settings()
        self._ttl = settings.leader_ttl
        self._elector = LeaderElector(
            redis.Redis.from_url(settings.redis_url, socket_timeout=2, socket_connect_timeout=2),
            ELECTION,
            self._ttl,
        )
        self._was_leader: bool | None = None
        self._outages = Outages(log)
        super().__init__(*args, **kwargs)
        current: float = getattr(self, "max_interval", self._ttl)
        self.max_interval = min(current, self._ttl / 3)

    def _leader(self) -> bool:
        try:
            leader = bool(self._elector.is_leader())
        except redis.RedisError as exc:
            self._outages.failed(REDIS, exc, "leader election (beat sends anyway)")
            return True
        self._outages.answered(REDIS)
        if leader != self._was_leader:
            log.info("beat is %s", "the leader: sending" if leader else "standing by: not sending")
            self._was_leader = leader
        return leader

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Send one due entry, as Celery does, except that a broker that does not answer is
        logged once per outage, not with a traceback per send (the entry goes again at its
        next due time)."""
        log.info("Scheduler: Sending due task %s (%s)", entry.name, entry.task)
        try:
            self.apply_async(entry, producer=producer, advance=False)
        except Exception as exc:
            cause = exc.__cause__ or exc.__context__ or exc  # Celery wraps it: SchedulingError
            service = service_of(cause)
            if service is None:
                log.error("Message Error: %s", exc, exc_info=True)
                return
            self._outages.failed(service, cause, f"sending {entry.task}")
            return
        self._outages.answered(BROKER)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if not self._leader():
            return self._ttl / 3
        interval: float = super().tick(*args, **kwargs)
        return min(interval, self._ttl / 3)
