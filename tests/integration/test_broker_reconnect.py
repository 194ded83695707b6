"""A lost broker connection's close, as Celery 5.7's consumer does it before reconnecting, on a
real Redis with an unacked message: Celery lets the AttributeError out (the worker exits);
harvest's consumer logs it and goes on (harvest.worker.consumer)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis
from kombu import Connection, Message, Queue  # type: ignore[attr-defined]

from harvest.settings import Settings
from harvest.worker.consumer import closing_may_fail


@pytest.fixture
def collected(settings: Settings, redis_client: redis.Redis) -> Iterator[Connection]:
    """A connection in the state Celery 5.7's collect() can leave it in: a message delivered and
    not acked, the channel still open, and the transport's client cleared."""
    conn = Connection(settings.redis_url)  # type: ignore[no-untyped-call]
    queue = Queue("harvest-test-reconnect")  # type: ignore[no-untyped-call]
    with conn.Producer() as producer:
        producer.publish({"n": 1}, routing_key=queue.name, declare=[queue])
    delivered: list[Message] = []
    consumer = conn.Consumer([queue], callbacks=[lambda _body, msg: delivered.append(msg)])
    consumer.qos(prefetch_count=1)
    consumer.consume()
    conn.drain_events(timeout=5)
    assert len(delivered) == 1
    conn.transport.client = None  # what collect() does once its channel close has failed
    yield conn
    redis_client.flushdb()


def test_celerys_close_raises_attribute_error(collected: Connection) -> None:
    # If kombu stops raising here, harvest.worker.consumer's guard can go.
    with pytest.raises(AttributeError, match="hostname"):
        collected.close()


def test_harvests_close_logs_and_goes_on(
    collected: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="harvest.worker"):
        closing_may_fail(collected.close)()
    assert "closing the lost broker connection failed (AttributeError" in caplog.text
