"""The one adapter between harvest and Celery: configuration, queues, and publishing.

harvest's library code sends messages only through :class:`Broker`; the Celery app in
``workers/`` is built from :func:`celery_config`. Messages carry job ids and lease tokens,
never payloads (payloads stay in Postgres).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import redis
from celery import Celery
from kombu import Exchange, Queue  # type: ignore[attr-defined]

from harvest.coordination import keys as rkeys
from harvest.jobs import Claimed
from harvest.redact import redact_url
from harvest.settings import Settings

log = logging.getLogger(__name__)

SCHEDULE_QUEUE = "schedule"
EXECUTION_QUEUE = "execution"
DISPATCH_TASK = "harvest.dispatch"
RESCUE_TASK = "harvest.rescue"
EXECUTE_TASK = "harvest.execute"
REDIS_SCHEMES = ("redis://", "rediss://", "redis+socket://")  # kombu's; the last is a socket


ACK_CONNECTIONS_SPARE = 10  # kombu's default pool: the consumer's, publishes, the pidbox


def sized_for_pool(
    options: dict[str, Any], broker_url: str, pool: str, concurrency: int
) -> dict[str, Any]:
    """The broker's transport options for a worker of ``pool`` at ``concurrency``. kombu's
    Redis transport opens at most ``max_connections`` (10) connections a channel and raises,
    rather than waits, when all are in use; a task acks its message from the thread or greenlet
    that ran it, so under ``-P threads`` or ``-P gevent`` as many acks as the concurrency can be
    on their way at once. At ``-P gevent -c 100`` 60 of 300 acks failed ("Couldn't ack ...
    MaxConnectionsError", celery/celery#1350): each message stayed unacked, its prefetch slot
    taken, until the visibility timeout. Other pools ack from one thread, and other brokers'
    transports have no such pool: unchanged."""
    if pool not in ("threads", "gevent") or not broker_url.startswith(REDIS_SCHEMES):
        return options
    wanted = concurrency + ACK_CONNECTIONS_SPARE
    return {**options, "max_connections": max(int(options.get("max_connections", 10)), wanted)}


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings harvest relies on (see the README's "Guarantees")."""
    transport_options: dict[str, Any] = {"visibility_timeout": settings.visibility_timeout}
    if settings.effective_broker_url.startswith(REDIS_SCHEMES):
        # A connection cut by a partition (no FIN, no RST) must fail in seconds, not hang a
        # consumer until TCP gives up. socket_timeout bounds synchronous commands (publish,
        # ack); kombu drops a BRPOP whose reply is overdue by brpop_timeout (1 s) +
        # health_check_interval, so a consumer on a half-open connection is back in about
        # 1 + 2 x 5 s (51 s with kombu's default of 25: seen in the partition chaos test).
        transport_options |= {
            "socket_timeout": 10.0,
            "socket_connect_timeout": 5.0,
            "socket_keepalive": True,
            "health_check_interval": 5,
        }
    return {
        "broker_url": settings.effective_broker_url,
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        "broker_pool_limit": 10,  # Celery's default; Flower starves for events with fewer
        # JSON only: a pickle message is refused before any code sees it.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        # Results live in Postgres; the Redis result backend costs 15-30 % for nothing.
        "task_ignore_result": True,
        "result_backend": None,
        # A message is acked after its task returns; a killed child's message is requeued.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": EXECUTION_QUEUE,
        "task_queues": (
            Queue(SCHEDULE_QUEUE, Exchange(SCHEDULE_QUEUE), routing_key=SCHEDULE_QUEUE),  # type: ignore[no-untyped-call]
            Queue(EXECUTION_QUEUE, Exchange(EXECUTION_QUEUE), routing_key=EXECUTION_QUEUE),  # type: ignore[no-untyped-call]
        ),
        "task_routes": {
            DISPATCH_TASK: {"queue": SCHEDULE_QUEUE},
            RESCUE_TASK: {"queue": SCHEDULE_QUEUE},
            "harvest.schedules": {"queue": SCHEDULE_QUEUE},
            "harvest.maintenance": {"queue": SCHEDULE_QUEUE},
            EXECUTE_TASK: {"queue": EXECUTION_QUEUE},
        },
        "task_create_missing_queues": True,
        "worker_hijack_root_logger": False,
        "worker_send_task_events": bool(settings.task_events),  # unset: -E decides
        "task_send_sent_event": False,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "broker_channel_error_retry": True,
        # Celery's consumer, guarded against Celery 5.7's reconnect exiting the worker.
        "worker_consumer": "harvest.worker.consumer:Consumer",
    }


def make_celery(settings: Settings, name: str = "harvest") -> Celery:
    """The app harvest publishes with. Never made Celery's current app: in a user's process,
    their ``current_app`` and ``shared_task`` stay theirs."""
    app = Celery(name, set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


MESSAGE_SECONDS = 0.05  # jobs share a message only while their run times add up to less
ASYNC_FACTOR = 8  # an async job's messages carry up to this many times max_jobs_per_message


def chunk(claimed: Sequence[Claimed], per_message: Mapping[str, int]) -> list[list[Claimed]]:
    """Group claimed jobs by queue and job name into messages of at most
    ``per_message[name]`` jobs (1 for a name not in it)."""
    groups: dict[tuple[str, str], list[Claimed]] = {}
    for job in claimed:
        groups.setdefault((job.queue, job.name), []).append(job)
    messages: list[list[Claimed]] = []
    for (_, name), jobs in groups.items():
        n = max(1, per_message.get(name, 1))
        messages += [jobs[i : i + n] for i in range(0, len(jobs), n)]
    return messages


def jobs_per_message(
    claimed: int,
    maximum: int,
    consumers: int,
    run_seconds: float | None = None,
    *,
    concurrent: bool = False,
) -> int:
    """How many jobs of one name each message of a claim carries.

    Several jobs a message is what lets harvest outrun plain Celery: each message costs the
    broker, the worker's main process and Celery's events about as much as a no-op job. But a
    message's jobs run one after another in one process, so only short jobs share: as many as
    fit in ``MESSAGE_SECONDS`` of their recent median run time (unknown: one a message), the
    claim spread over the consumers (one message each at least), at most ``maximum``.

    ``concurrent``: the jobs run at once on the worker's event loop (``async def`` handlers),
    so none waits for a sibling: the claim is spread over the consumers whatever their run
    time, up to :data:`ASYNC_FACTOR` times ``maximum`` a message (the worker hands a message's
    jobs to its loop as it has room for them). Measured with no-op async jobs: messages of 64
    instead of 16 took a quarter off each job's execution CPU (Celery's receive, reserve and
    ack of each message, in the worker's main process and its child)."""
    if concurrent:
        return max(1, min(maximum * ASYNC_FACTOR, -(-claimed // max(1, consumers))))
    if claimed <= consumers or run_seconds is None:
        return 1
    by_time = int(MESSAGE_SECONDS / max(run_seconds, 1e-4))
    return max(1, min(maximum, -(-claimed // consumers), by_time))


def argsrepr(jobs: Sequence[Claimed]) -> str:
    """What Celery's tools (``celery inspect active``, Flower) show for an execution message:
    its jobs as ``name#id``, never their lease tokens."""
    text = "[" + ", ".join(f"{job.name}#{job.id}" for job in jobs) + "]"
    return text if len(text) <= 1024 else text[:1020] + "...]"


class Broker:
    """Publishes harvest's messages. Publishing failures propagate: the dispatcher has already
    committed its claim, and rescue re-queues anything that was claimed but never published."""

    def __init__(self, settings: Settings, celery: Celery | None = None) -> None:
        self.settings = settings
        self.celery = celery or make_celery(settings)
        self._redis: redis.Redis | None = None

    def marked_anew(self) -> bool:
        """Mark a Redis broker as holding harvest's queues (``SET NX``, no expiry); True when
        the mark was missing, so the broker holds none of the messages published before it
        lost its data (a restart without persistence, a flush, a failover to an empty
        replica), or harvest never published there. False for other brokers: RabbitMQ's
        queues are durable."""
        url = self.settings.effective_broker_url
        if not url.startswith(REDIS_SCHEMES):
            return False
        if self._redis is None:
            url = url.replace("redis+socket://", "unix://", 1)  # redis-py's name for a socket
            self._redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        return bool(self._redis.set(rkeys.broker_mark(), b"1", nx=True))

    def publish_jobs(self, messages: Sequence[Sequence[Claimed]]) -> None:
        with self.celery.producer_or_acquire() as producer:
            for jobs in messages:
                body = [[job.id, str(job.token), job.name] for job in jobs]
                self.celery.send_task(
                    EXECUTE_TASK,
                    args=[body],
                    queue=jobs[0].queue,
                    producer=producer,
                    argsrepr=argsrepr(jobs),
                )

    def nudge_dispatch(self) -> None:
        self.celery.send_task(DISPATCH_TASK, queue=SCHEDULE_QUEUE)

    def describe(self) -> str:
        return redact_url(self.settings.effective_broker_url)

    def close(self) -> None:
        self.celery.close()
        if self._redis is not None:
            self._redis.close()
