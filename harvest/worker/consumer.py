"""Celery's worker consumer with one guard, for the reconnect of Celery 5.7.

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
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer

log = logging.getLogger("harvest.worker")


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


class Consumer(CeleryConsumer):  # type: ignore[misc]
    """Celery's consumer; a lost connection's close may fail (module docstring)."""

    def on_connection_error_after_connected(self, exc: BaseException) -> None:
        connection = self.connection
        if connection is not None:
            connection.close = closing_may_fail(connection.close)
        super().on_connection_error_after_connected(exc)
