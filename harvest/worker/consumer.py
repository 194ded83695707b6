"""Celery's worker consumer with two guards, for the reconnect of Celery 5.7 on Redis.

When the broker connection is lost, Celery 5.7's consumer collects the connection and then
closes it (``Consumer.on_connection_error_after_connected``) before it reconnects. With the
Redis transport, ``collect()`` first clears the transport's client; if closing a channel
failed during that collect (its BRPOP read hit the dead socket before the channel was marked
closed), the close that follows reaches ``restore_unacked`` through that cleared client and
raises ``AttributeError: 'NoneType' object has no attribute 'hostname'``. ``ignore_errors``
ignores only connection and channel errors, so the worker exits (seen once in the chaos test
F4, a Redis restart mid-run, exit code 1).

The connection being closed is thrown away either way, and its unacked messages come back
through the broker's visibility timeout (or were lost with a Redis that kept no data, which
harvest's rescue from Postgres covers). So here that close may fail: the failure is logged
and the consumer goes on to reconnect, as it does when the close succeeds.

When that close failed, the lost connection's channel never got the Redis client it settles
messages with, and the cleared client is all it has: a task that was running when the
connection was lost and ends after the reconnect sends its acknowledgement (``acks_late``; or
its rejection, when its process died) to that channel, which raises the same
``AttributeError`` on the consumer's event loop, outside ``ack_log_error``'s handling of
connection errors, and the worker exits (F4 once more, with the close guarded; with RabbitMQ
the channel raises a connection error, which kombu logs). That message cannot be settled any
more: the broker hands it out again after its visibility timeout, or lost it with a Redis that
kept nothing, and the job's row in Postgres decides whether anything runs again (a finished
job's redelivery is suppressed as a duplicate). So such a settlement is logged and dropped.

A settlement on its way when the broker stops (its connection fails under the ack) is the same
case seen earlier: kombu logs it as critical, with a traceback, and goes on. harvest logs it as
one warning, as the rest of an outage it rides out (chaos F4 checks the log of a worker run as
the README runs it for tracebacks).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any

from celery.exceptions import CPendingDeprecationWarning
from celery.worker.consumer import Consumer as CeleryConsumer
from celery.worker.consumer.gossip import Gossip as CeleryGossip

log = logging.getLogger("harvest.worker")


def quiet_cancel_warning() -> None:
    """Keep Celery 5.7's warning about cancelling on connection loss out of the log.

    At every lost broker connection Celery warns (six lines) that Celery 6 will cancel the
    running tasks of a lost connection unless worker_cancel_long_running_tasks_on_connection_loss
    says otherwise. harvest says otherwise on purpose (harvest.broker): a job that keeps running
    ends with a fenced write in Postgres, and its message's redelivery is suppressed as a
    duplicate, so cancelling it would only waste the call. Installed when the consumer is made,
    after the worker's log setup has put its own filter (``always``, for Celery's deprecation
    warnings) in front."""
    warnings.filterwarnings(
        "ignore",
        message=r"\s*In Celery 5\.1 we introduced an optional breaking change",
        category=CPendingDeprecationWarning,
    )


def closing_may_fail(close: Callable[[], Any]) -> Callable[[], Any]:
    """``close`` of a lost broker connection, where the transport's cleared client
    (``AttributeError``) is logged instead of raised."""

    @functools.wraps(close)
    def guarded() -> Any:
        try:
            return close()
        except AttributeError as exc:
            log.warning(
                "closing the lost broker connection failed (%s: %s); its unacked messages "
                "come back by the visibility timeout; reconnecting",
                type(exc).__name__,
                exc,
            )
            return None

    return guarded


def _lost(message: Any) -> bool:
    """Whether ``message`` came on a broker connection that has since been closed (kombu clears
    the transport's client when it closes or collects a connection)."""
    transport = getattr(getattr(message, "channel", None), "connection", None)
    return transport is not None and getattr(transport, "client", True) is None


def _unsettled(message: Any, reason: object) -> None:
    log.warning(
        "message %s could not be settled with the broker (%s); the broker hands it out again "
        "after its visibility timeout (or lost it with a Redis that kept nothing), and its "
        "job's row in Postgres decides whether anything runs again",
        getattr(message, "delivery_tag", "?"),
        reason,
    )


class _SettleLog:
    """The logger handed to kombu's ``ack_log_error`` / ``reject_log_error``, whose only call is
    ``critical(..., exc_info=True)`` when the broker's connection fails under the settlement (a
    Redis stopped while a task's acknowledgement was on its way: chaos F4). That is an outage the
    worker rides out, not a crash: one warning line, without kombu's traceback."""

    def __init__(self, message: Any) -> None:
        self.message = message

    def critical(self, _msg: str, *args: Any, **_kwargs: Any) -> None:
        exc = args[-1] if args else "?"
        _unsettled(self.message, f"{type(exc).__name__}: {exc}")


def settling_may_fail(settle: Callable[..., Any]) -> Callable[..., Any]:
    """``message.ack_log_error`` (or ``reject_log_error``), called as Celery calls it
    (``logger, connection_errors[, requeue]``), where a settlement the broker could not take is
    one warning: the broker's connection failed under it (kombu would log it as critical, with a
    traceback), or the message came on a connection that has since been lost (kombu would raise
    ``AttributeError``). One per acknowledgement: a plain closure (no ``functools.wraps``)."""
    message = getattr(settle, "__self__", None)

    def guarded(_logger: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return settle(_SettleLog(message), *args, **kwargs)
        except AttributeError as exc:
            if not _lost(message):
                raise
            _unsettled(message, f"{type(exc).__name__}: it came on a connection since lost")
            return None

    return guarded


class Gossip(CeleryGossip):  # type: ignore[misc]
    """Celery's gossip step (on by default: the README's worker commands run it), whose stop
    after a lost broker connection does not fail.

    Celery 5.7 closes a lost connection and clears the consumer's reference to it
    (``Consumer.on_connection_error_after_connected``) before it stops its steps to reconnect.
    Gossip's stop then closed its channel through ``ignore_errors(c.connection, ...)`` with no
    connection, and whenever that close met the dead socket (kombu's ``ignore_errors`` then
    reads the missing connection's error classes) the ``AttributeError`` was logged as "Error
    on restarting Gossip" with a traceback. The channel was the lost connection's: it went
    with it, and there is nothing left to close."""

    def _close(self, c: Any, cancel_consumers: bool = True) -> None:
        if c.connection is None:
            self.consumers = None
            return
        super()._close(c, cancel_consumers)


_CELERY_GOSSIP = "celery.worker.consumer.gossip:Gossip"


class Consumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's consumer; a lost connection's close, and the settling of its messages, may
    fail (module docstring); Celery's warning about cancelling on connection loss is not
    repeated (:func:`quiet_cancel_warning`); its gossip step stops cleanly after a lost
    connection (:class:`Gossip`)."""

    class Blueprint(CeleryConsumer.Blueprint):  # type: ignore[misc]
        default_steps = [
            f"{__name__}:Gossip" if step == _CELERY_GOSSIP else step
            for step in CeleryConsumer.Blueprint.default_steps
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        quiet_cancel_warning()
        super().__init__(*args, **kwargs)

    def call_soon_ack(self, p: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return super().call_soon_ack(settling_may_fail(p), *args, **kwargs)

    def on_connection_error_after_connected(self, exc: BaseException) -> None:
        connection = self.connection
        if connection is not None:
            connection.close = closing_may_fail(connection.close)
        super().on_connection_error_after_connected(exc)
