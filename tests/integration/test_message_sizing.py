"""How many jobs share an execution message: short ones do (their recent run time says so),
long or unknown ones travel alone, and a claim is spread over the consumers."""

from __future__ import annotations

import redis
from sqlalchemy import Engine, text

from harvest import dispatcher, store
from harvest.app import Harvest
from harvest.settings import Settings
from tests.helpers import RecordingBroker


def _finished(engine: Engine, name: str, n: int, seconds: float) -> None:
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO harvest_jobs (name, status, started_at, finished_at) "
                "SELECT :name, 'succeeded', now() - make_interval(secs => :s), now() "
                "FROM generate_series(1, :n)"
            ),
            {"name": name, "n": n, "s": seconds},
        )


def test_recent_run_seconds_is_the_median_of_the_last_finished(clean_db: Engine) -> None:
    _finished(clean_db, "noop", 30, 0.002)
    _finished(clean_db, "sleepy", 30, 4.0)
    with clean_db.connect() as conn:
        runs = store.recent_run_seconds(conn)
    assert abs(runs["noop"] - 0.002) < 1e-6
    assert abs(runs["sleepy"] - 4.0) < 1e-6


def test_short_jobs_share_messages_and_long_ones_travel_alone(
    migrated: Settings, clean_db: Engine, redis_client: redis.Redis
) -> None:
    settings = migrated.model_copy(update={"worker_concurrency": 2, "max_jobs_per_message": 16})
    broker = RecordingBroker(settings)
    app = Harvest(settings, broker=broker, redis_client=redis_client)
    app.load_imports(["tests.jobs"])
    try:
        _finished(clean_db, "noop", 30, 0.002)
        _finished(clean_db, "sleepy", 30, 4.0)
        dispatcher._RUN_TIMES = dispatcher._RunTimes()  # forget other tests' databases
        fast = set(app.enqueue_many("noop", [{}] * 100))
        slow = set(app.enqueue_many("sleepy", [{"seconds": 0}] * 6))
        dispatcher.dispatch(app)
        by_kind = {
            "fast": [m for m in broker.messages if set(m) <= fast],
            "slow": [m for m in broker.messages if set(m) <= slow],
        }
        assert len(by_kind["fast"]) + len(by_kind["slow"]) == len(broker.messages)
        assert sum(map(len, by_kind["fast"])) == 100
        assert max(map(len, by_kind["fast"])) == 16  # 2 ms jobs: up to 16 a message
        assert sorted(map(len, by_kind["slow"])) == [1] * 6  # 4 s jobs: one a message
    finally:
        app.close()
