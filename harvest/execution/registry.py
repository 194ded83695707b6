"""Which execution processes are alive, what each can run, and what it runs now.

Every execution process writes its :class:`WorkerInfo` to Redis every few seconds with a TTL
(judged by the Redis clock, one Lua script); a process that stops writing disappears within
its TTL. The dispatcher sizes the in-flight window and spreads messages from it; the dashboard
and ``harvest workers`` show it. Postgres stays the truth about jobs: this is only who is up.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from redis import Redis

from harvest.coordination import keys
from harvest.coordination.scripts import LuaScript, text

MAX_RUNNING_LISTED = 1000  # job ids one process lists as running now (the count is exact)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """One execution process, as it last described itself."""

    id: str  # hostname:pid
    hostname: str
    pid: int
    queues: tuple[str, ...]
    pool: str  # Celery pool: prefork, solo, threads, gevent
    concurrency: int  # sync jobs at once (Celery's -c; 1 for a prefork child)
    async_concurrency: int  # async jobs at once on its event loop (0: none)
    started_at: float  # seconds since the epoch
    in_flight: int = 0  # jobs held or running now
    running: tuple[int, ...] = field(default_factory=tuple)  # ids, at most MAX_RUNNING_LISTED
    last_seen: float = 0.0  # Redis time, seconds since the epoch

    @property
    def slots(self) -> int:
        """Jobs it can run at once."""
        return self.concurrency + self.async_concurrency

    def as_fields(self) -> list[str]:
        values = asdict(self)
        values.pop("last_seen")
        values["queues"] = ",".join(self.queues)
        values["running"] = json.dumps(list(self.running[:MAX_RUNNING_LISTED]))
        out: list[str] = []
        for name, value in values.items():
            out += [name, str(value)]
        return out

    @classmethod
    def from_fields(cls, raw: list[Any]) -> WorkerInfo:
        values = {text(raw[i]): text(raw[i + 1]) for i in range(0, len(raw) - 1, 2)}
        return cls(
            id=values["id"],
            hostname=values["hostname"],
            pid=int(values["pid"]),
            queues=tuple(q for q in values["queues"].split(",") if q),
            pool=values["pool"],
            concurrency=int(values["concurrency"]),
            async_concurrency=int(values["async_concurrency"]),
            started_at=float(values["started_at"]),
            in_flight=int(values.get("in_flight", "0")),
            running=tuple(int(i) for i in json.loads(values.get("running", "[]"))),
            last_seen=int(values.get("last_seen_ms", "0")) / 1000,
        )


def beat(redis: Redis, info: WorkerInfo, *, ttl: float) -> None:
    """Say ``info``'s process is alive for ``ttl`` more seconds (Redis clock)."""
    LuaScript(redis, "worker_beat")(
        [keys.worker_index(), keys.worker_info(info.id)],
        [info.id, max(1, round(ttl * 1000)), *info.as_fields()],
    )


def leave(redis: Redis, worker_id: str) -> None:
    """Remove a process that is stopping (it would expire by itself within its TTL)."""
    pipe = redis.pipeline()
    pipe.zrem(keys.worker_index(), worker_id)
    pipe.delete(keys.worker_info(worker_id))
    pipe.execute()


def live(redis: Redis) -> list[WorkerInfo]:
    """Every live execution process, oldest first."""
    reply = LuaScript(redis, "worker_list").array([keys.worker_index()], [keys.worker_info("")])
    rows = reply[1:]
    found = [WorkerInfo.from_fields(rows[i + 1]) for i in range(0, len(rows) - 1, 2)]
    return sorted(found, key=lambda w: (w.started_at, w.id))
