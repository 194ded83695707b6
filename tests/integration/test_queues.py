"""Pausing a queue: dispatch's claim takes none of its jobs until it is resumed, the pause is
kept in Postgres (a new process sees it), each pause or resume is one atomic statement, and a
bad name is refused with a typed error, storing nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from sqlalchemy import Engine, text

from harvest import store
from harvest.app import Harvest
from harvest.errors import InvalidOption, QueueNotFound
from harvest.settings import Settings


@pytest.fixture
def app(jobs_app: Callable[..., Harvest]) -> Harvest:
    return jobs_app()


def insert_due(engine: Engine, queue: str, n: int, *, age: float = 1.0) -> list[int]:
    with engine.begin() as conn:
        return list(
            conn.execute(
                text(
                    "INSERT INTO harvest_jobs (name, queue, run_at) SELECT 'noop', :queue, "
                    "now() - make_interval(secs => :age) FROM generate_series(1, :n) RETURNING id"
                ),
                {"queue": queue, "n": n, "age": age},
            ).scalars()
        )


def claimed_queues(engine: Engine, **options: object) -> list[str]:
    with engine.begin() as conn:
        return [c.queue for c in store.claim_due(conn, limit=100, ttl=300, **options)]  # type: ignore[arg-type]


def paused_rows(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT queue FROM harvest_queue_pauses")).scalars())


@pytest.mark.parametrize(
    "options",
    [{}, {"budgets": {"p": 5}}, {"starvation_after": 0.5}],
    ids=["plain", "budgeted", "aged-share"],
)
def test_a_paused_queue_is_not_claimed_until_resumed(
    app: Harvest, clean_db: Engine, options: dict[str, object]
) -> None:
    insert_due(clean_db, "execution", 3, age=5)
    insert_due(clean_db, "bulk", 4, age=10)  # older: it would be claimed first (and aged)
    change = app.pause_queue("bulk")
    assert change.changed and change.queue.paused and change.queue.ready == 4

    assert claimed_queues(clean_db, **options) == ["execution"] * 3
    assert claimed_queues(clean_db, **options) == []  # the paused jobs are still not taken

    assert app.resume_queue("bulk").changed
    assert claimed_queues(clean_db, **options) == ["bulk"] * 4


def test_the_pause_is_kept_in_postgres_across_restarts(
    migrated: Settings, app: Harvest, clean_db: Engine
) -> None:
    insert_due(clean_db, "bulk", 2)
    app.pause_queue("bulk")
    app.close()
    restarted = Harvest(migrated)  # a new process would see the same: nothing is in memory
    try:
        bulk = {q.name: q for q in restarted.list_queues()}["bulk"]
        assert bulk.paused and bulk.paused_at is not None and bulk.pending == 2
        assert claimed_queues(clean_db) == []
        assert restarted.resume_queue("bulk").changed
    finally:
        restarted.close()
    assert paused_rows(clean_db) == []


def test_pause_and_resume_are_idempotent_and_list_every_known_queue(
    app: Harvest, clean_db: Engine
) -> None:
    insert_due(clean_db, "bulk", 2)
    with clean_db.begin() as conn:
        conn.execute(text("INSERT INTO harvest_jobs (name, queue, run_at) "
                          "VALUES ('noop', 'bulk', now() + interval '1 hour')"))  # fmt: skip
    assert app.pause_queue("bulk").changed is True
    assert app.pause_queue("bulk").changed is False
    # A registered queue with no job yet can be paused ahead of its jobs.
    assert app.pause_queue("execution").changed is True
    queues = {q.name: q for q in app.list_queues()}
    assert set(queues) == {"bulk", "execution"}
    assert (queues["bulk"].pending, queues["bulk"].ready, queues["bulk"].running) == (3, 2, 0)
    assert queues["bulk"].paused and queues["execution"].paused
    assert app.resume_queue("bulk").changed is True
    assert app.resume_queue("bulk").changed is False
    assert sorted(paused_rows(clean_db)) == ["execution"]


@pytest.mark.parametrize("name", ["", "   ", "a\x00b", "tab\there", "x" * 201, 7, None])
def test_a_malformed_queue_name_is_refused_and_nothing_is_stored(
    app: Harvest, clean_db: Engine, name: object
) -> None:
    with pytest.raises(InvalidOption, match="invalid queue"):
        app.pause_queue(name)  # type: ignore[arg-type]
    with pytest.raises(InvalidOption, match="invalid queue"):
        app.resume_queue(name)  # type: ignore[arg-type]
    with pytest.raises(InvalidOption, match="invalid queue"):
        app.job("bad_queue_job", queue=name)  # type: ignore[arg-type]
    assert paused_rows(clean_db) == []


def test_an_unknown_queue_is_refused_and_nothing_is_stored(app: Harvest, clean_db: Engine) -> None:
    with pytest.raises(QueueNotFound, match="unknown queue 'nowhere'") as raised:
        app.pause_queue("nowhere")
    assert raised.value.queue == "nowhere"
    with pytest.raises(QueueNotFound):
        app.resume_queue("nowhere")
    assert paused_rows(clean_db) == []


def _all_at_once(callers: list[Harvest], act: str) -> list[bool]:
    """``act`` ("pause_queue" or "resume_queue") of "bulk" by every caller at the same moment."""
    barrier = threading.Barrier(len(callers))
    changed: list[bool] = []

    def call(h: Harvest) -> None:
        barrier.wait()
        changed.append(getattr(h, act)("bulk").changed)

    threads = [threading.Thread(target=call, args=(h,)) for h in callers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return changed


def test_concurrent_pauses_and_resumes_change_the_queue_exactly_once(
    migrated: Settings, app: Harvest, clean_db: Engine
) -> None:
    insert_due(clean_db, "bulk", 1)
    callers = [Harvest(migrated) for _ in range(8)]
    try:
        for act in ("pause_queue", "resume_queue"):
            changed = _all_at_once(callers, act)
            assert sorted(changed) == [False] * 7 + [True], act
            assert paused_rows(clean_db) == (["bulk"] if act == "pause_queue" else [])
    finally:
        for h in callers:
            h.close()


def test_the_cli_lists_pauses_and_resumes_a_queue(
    migrated: Settings, clean_db: Engine, redis_client: object
) -> None:
    from tests.integration.test_cli import Cli, base_env

    cli = Cli(
        base_env(HARVEST_DATABASE_URL=migrated.database_url, HARVEST_REDIS_URL=migrated.redis_url)
    )
    insert_due(clean_db, "bulk", 3)
    assert cli.ok("queues", "pause", "bulk").strip() == "queue bulk: paused, 3 pending"
    assert "(it already was)" in cli.ok("queues", "pause", "bulk")
    listing = cli.ok("queues", "ls")
    bulk = next(line for line in listing.splitlines() if "│ bulk" in line)
    assert [c.strip() for c in bulk.split("│")[1:6]] == ["bulk", "3", "3", "0", "paused"]
    assert claimed_queues(clean_db) == []
    assert cli.ok("queues", "resume", "bulk").strip() == "queue bulk: active, 3 due now"
    assert "unknown queue 'nowhere'" in cli.refused("queues", "pause", "nowhere")
    assert "invalid queue" in cli.refused("queues", "resume", " ")
    assert paused_rows(clean_db) == []
    assert claimed_queues(clean_db) == ["bulk"] * 3
