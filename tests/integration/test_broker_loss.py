"""A Redis broker that lost its data (a restart without persistence, a flush): the dispatcher
finds harvest's mark gone and takes the dispatched jobs back at once, to send them again,
rather than leaving them to rescue after HARVEST_DISPATCH_TTL (harvest.dispatcher)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import pytest
import redis
from sqlalchemy import Engine, text

from harvest import dispatcher, store
from harvest.app import Harvest
from harvest.broker import Broker
from harvest.settings import Settings


@pytest.fixture
def app(jobs_app: Callable[..., Harvest]) -> Harvest:
    return jobs_app()


def dispatched(engine: Engine) -> dict[int, uuid.UUID]:
    """{job id: lease token} of the dispatched jobs."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, lease_token FROM harvest_jobs WHERE status = 'dispatched'")
        )
        return {r.id: r.lease_token for r in rows}


def rescued(engine: Engine) -> int:
    with engine.connect() as conn:
        return store.counters(conn).get(dispatcher.RESCUED, 0)


def thirty_dispatched(app: Harvest, redis_client: redis.Redis) -> dict[int, uuid.UUID]:
    """30 jobs enqueued and dispatched, their messages in the broker: {job id: lease token}."""
    ids = app.enqueue_many("echo", [{"value": i} for i in range(30)])
    dispatcher.dispatch(app)
    before = dispatched(app.engine)
    assert set(before) == set(ids) and redis_client.llen("execution") > 0
    return before


def test_a_broker_that_lost_its_messages_gets_the_dispatched_jobs_sent_again_at_once(
    app: Harvest, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    before = thirty_dispatched(app, redis_client)
    redis_client.flushdb()  # what a Redis restarted without persistence holds: nothing
    with caplog.at_level(logging.WARNING, logger="harvest.dispatcher"):
        dispatcher.dispatch(app)
    after = dispatched(app.engine)
    assert set(after) == set(before)
    assert not set(after.values()) & set(before.values()), "sent again, under new tokens"
    assert redis_client.llen("execution") > 0
    assert "so 30 dispatched jobs were taken back to be sent again" in caplog.text
    assert rescued(app.engine) == 30


def test_a_broker_that_kept_its_messages_keeps_its_jobs(
    app: Harvest, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    before = thirty_dispatched(app, redis_client)
    messages = redis_client.llen("execution")
    with caplog.at_level(logging.WARNING, logger="harvest.dispatcher"):
        dispatcher.dispatch(app)
    assert dispatched(app.engine) == before
    assert redis_client.llen("execution") == messages
    assert "taken back" not in caplog.text
    assert rescued(app.engine) == 0


def test_of_two_dispatchers_that_find_the_mark_gone_one_takes_the_jobs_back(
    jobs_app: Callable[..., Harvest], redis_client: redis.Redis
) -> None:
    first, second = jobs_app(), jobs_app()
    first.enqueue_many("echo", [{"value": i} for i in range(10)])
    dispatcher.dispatch(first)
    redis_client.flushdb()
    assert first.broker.marked_anew() is True
    assert second.broker.marked_anew() is False


def test_a_rabbitmq_broker_is_never_taken_for_a_lost_one(migrated: Settings) -> None:
    broker = Broker(migrated.model_copy(update={"broker_url": "amqp://guest:guest@127.0.0.1:1//"}))
    try:
        assert broker.marked_anew() is False  # durable queues; and no connection is made
    finally:
        broker.close()
