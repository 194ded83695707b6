"""A lost broker connection's close, as Celery 5.7's consumer does it before reconnecting, and
the acknowledgement of a message it delivered, sent after it was lost (a task that ran across
the reconnect), on a real Redis: Celery lets the AttributeError out (the worker exits);
harvest's consumer logs it and goes on (harvest.worker.consumer)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis
from kombu import Connection, Message, Queue  # type: ignore[attr-defined]

from harvest.settings import Settings
from harvest.worker.consumer import closing_may_fail, settling_may_fail
from tests.processes.conftest import PrivateRedis

log = logging.getLogger("tests.reconnect")


@pytest.fixture
def delivered(
    settings: Settings, redis_client: redis.Redis
) -> Iterator[tuple[Connection, Message]]:
    """A connection in the state Celery 5.7's collect() can leave it in: a message delivered and
    not acked, the channel still open, and the transport's client cleared."""
    conn = Connection(settings.redis_url)  # type: ignore[no-untyped-call]
    queue = Queue("harvest-test-reconnect")  # type: ignore[no-untyped-call]
    with conn.Producer() as producer:
        producer.publish({"n": 1}, routing_key=queue.name, declare=[queue])
    got: list[Message] = []
    consumer = conn.Consumer([queue], callbacks=[lambda _body, msg: got.append(msg)])
    consumer.qos(prefetch_count=1)
    consumer.consume()
    conn.drain_events(timeout=5)
    assert len(got) == 1
    conn.transport.client = None  # what collect() does once its channel close has failed
    yield conn, got[0]
    redis_client.flushdb()


@pytest.fixture
def collected(delivered: tuple[Connection, Message]) -> Connection:
    return delivered[0]


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


def lost(delivered: tuple[Connection, Message]) -> Message:
    """The message, once the consumer has closed its lost connection and gone on."""
    conn, message = delivered
    closing_may_fail(conn.close)()
    return message


def test_celerys_ack_of_a_message_of_a_lost_connection_raises_attribute_error(
    delivered: tuple[Connection, Message],
) -> None:
    message = lost(delivered)
    # If kombu stops raising here, harvest.worker.consumer's settling_may_fail can go.
    with pytest.raises(AttributeError, match="hostname"):
        message.ack_log_error(log, delivered[0].connection_errors)


@pytest.mark.parametrize("settle", ["ack_log_error", "reject_log_error"])
def test_harvest_logs_a_message_of_a_lost_connection_as_unsettled_and_goes_on(
    delivered: tuple[Connection, Message], caplog: pytest.LogCaptureFixture, settle: str
) -> None:
    message = lost(delivered)
    with caplog.at_level(logging.WARNING, logger="harvest.worker"):
        settling_may_fail(getattr(message, settle))(log, delivered[0].connection_errors)
    assert "could not be settled with the broker (AttributeError: it came on a connection" in (
        caplog.text
    )


def test_an_attribute_error_of_a_live_connection_is_not_swallowed(
    delivered: tuple[Connection, Message],
) -> None:
    conn, message = delivered
    conn.transport.client = conn  # live again: the guard must not hide a real bug

    class Broken:
        channel = message.channel

        def ack_log_error(self, *_: object) -> None:
            raise AttributeError("a bug, not a lost connection")

    with pytest.raises(AttributeError, match="a bug"):
        settling_may_fail(Broken().ack_log_error)(log, ())


@pytest.fixture
def stranded() -> Iterator[tuple[Connection, Message]]:
    """A message delivered and not acked by a Redis that has since stopped: its task ended while
    the broker was down (chaos F4)."""
    server = PrivateRedis().start()
    conn = Connection(server.url)  # type: ignore[no-untyped-call]
    try:
        queue = Queue("harvest-test-stranded")  # type: ignore[no-untyped-call]
        with conn.Producer() as producer:
            producer.publish({"n": 1}, routing_key=queue.name, declare=[queue])
        got: list[Message] = []
        consumer = conn.Consumer([queue], callbacks=[lambda _body, msg: got.append(msg)])
        consumer.consume()
        conn.drain_events(timeout=5)
        assert len(got) == 1
        server.kill()
        yield conn, got[0]
    finally:
        server.kill()
        conn.release()


@pytest.mark.parametrize("settle", ["ack_log_error", "reject_log_error"])
def test_kombu_logs_a_settlement_under_a_stopped_broker_as_critical_with_a_traceback(
    stranded: tuple[Connection, Message], caplog: pytest.LogCaptureFixture, settle: str
) -> None:
    # If kombu stops doing so, harvest.worker.consumer's _SettleLog can go.
    conn, message = stranded
    with caplog.at_level(logging.WARNING):
        getattr(message, settle)(log, conn.connection_errors)
    assert [r.levelname for r in caplog.records] == ["CRITICAL"]
    assert caplog.records[0].exc_info is not None


@pytest.mark.parametrize("settle", ["ack_log_error", "reject_log_error"])
def test_harvest_logs_a_settlement_under_a_stopped_broker_as_one_warning(
    stranded: tuple[Connection, Message], caplog: pytest.LogCaptureFixture, settle: str
) -> None:
    conn, message = stranded
    with caplog.at_level(logging.WARNING):
        settling_may_fail(getattr(message, settle))(log, conn.connection_errors)
    assert [(r.name, r.levelname) for r in caplog.records] == [("harvest.worker", "WARNING")]
    record = caplog.records[0]
    assert record.exc_info is None and "Traceback" not in caplog.text
    assert "could not be settled with the broker (ConnectionError: " in record.getMessage()
