"""Enqueue nudges the dispatcher, coalesced across callers through Redis."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import Engine

from harvest.app import Harvest
from harvest.broker import Broker
from harvest.settings import Settings


class CountingBroker(Broker):
    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.nudges = 0
        self._lock = threading.Lock()

    def nudge_dispatch(self) -> None:  # counts instead of publishing
        with self._lock:
            self.nudges += 1


@pytest.fixture
def counting_app(migrated: Settings, clean_db: Engine, redis_client: object) -> Harvest:
    app = Harvest(migrated, broker=CountingBroker(migrated))
    app.load_imports(["tests.jobs"])
    return app


@pytest.mark.slow
def test_a_burst_of_two_thousand_enqueues_sends_a_handful_of_nudges(counting_app: Harvest) -> None:
    started = time.monotonic()

    def burst() -> None:
        for i in range(500):
            counting_app.enqueue("echo", {"value": i})

    threads = [threading.Thread(target=burst) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    nudges = counting_app.broker.nudges  # type: ignore[attr-defined]
    # At most one per coalescing window (1 s), plus the first.
    assert 1 <= nudges <= elapsed / (counting_app.settings.nudge_coalesce_ms / 1000) + 2
    assert nudges < 40, f"{nudges} nudges for 2,000 enqueues in {elapsed:.1f}s"


def test_delayed_and_bulk_enqueues_nudge_sensibly(counting_app: Harvest) -> None:
    counting_app.enqueue("echo", {"value": 1}, delay=60)
    assert counting_app.broker.nudges == 0  # type: ignore[attr-defined]  # not due: no nudge
    counting_app.enqueue_many("echo", [{"value": i} for i in range(1000)])
    assert counting_app.broker.nudges == 1  # type: ignore[attr-defined]  # one for the lot


def test_enqueue_still_stores_the_job_when_the_nudge_fails(
    migrated: Settings, clean_db: Engine
) -> None:
    # Redis unreachable: the job is stored anyway (beat finds it), and no exception escapes.
    broken = migrated.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    app = Harvest(broken)
    app.load_imports(["tests.jobs"])
    ref = app.enqueue("echo", {"value": 2})
    assert app.get(ref.id).status == "pending"
    app.close()
