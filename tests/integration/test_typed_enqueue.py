"""``job.enqueue(...)`` stores the same job as ``app.enqueue(name, payload)``, options included,
and runs like any other."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import Engine

from harvest import Harvest, JobContext
from harvest.errors import InvalidPayload
from harvest.models import JobStatus
from harvest.runner import Runner
from harvest.settings import Settings
from tests.helpers import body, claim_all


@pytest.fixture
def app(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Iterator[Harvest]:
    harvest = Harvest(migrated)
    yield harvest
    harvest.close()


def test_typed_enqueue_stores_the_payload_and_options(
    app: Harvest, runner: Runner, clean_db: Engine
) -> None:
    @app.job("fetch_page", max_attempts=4)
    def fetch_page(ctx: JobContext, url: str, depth: int = 0) -> dict[str, object]:
        return {"url": url, "depth": depth}

    plain = fetch_page.enqueue("https://example.org", depth=2)
    chosen = fetch_page.options(priority=7, max_attempts=2, idempotency_key="k").enqueue(
        url="https://example.org/b"
    )
    delayed = fetch_page.options(delay=3600).enqueue(url="https://example.org/later")
    assert app.get(plain.id).payload == {"url": "https://example.org", "depth": 2}
    job = app.get(chosen.id)
    assert (job.payload, job.priority, job.max_attempts, job.idempotency_key) == (
        {"url": "https://example.org/b"},
        7,
        2,
        "k",
    )
    assert app.get(delayed.id).run_at > app.get(plain.id).run_at
    runner.execute(body(claim_all(clean_db)))
    assert app.get(plain.id).result == {"url": "https://example.org", "depth": 2}
    assert app.get(chosen.id).status is JobStatus.SUCCEEDED
    assert app.get(delayed.id).status is JobStatus.PENDING


def test_a_wrong_payload_is_refused_at_the_door_as_with_app_enqueue(app: Harvest) -> None:
    @app.job("strict")
    def strict(ctx: JobContext, url: str) -> None:
        pass

    with pytest.raises(InvalidPayload):
        strict.enqueue(uri="https://example.org")  # type: ignore[call-arg]
