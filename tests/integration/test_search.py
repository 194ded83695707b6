"""Searching jobs in Postgres: by id, name and payload path (containment, served by the GIN
index), combined with the other filters; the search reaches SQL only as a bound parameter."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy import Engine, text

from harvest import store
from harvest.app import Harvest
from harvest.search import parse
from harvest.settings import Settings


@pytest.fixture
def app(jobs_app: Callable[..., Harvest]) -> Harvest:
    return jobs_app()


def found(engine: Engine, typed: str, **filters: object) -> list[int]:
    with engine.begin() as conn:
        return [j.id for j in store.list_jobs_page(conn, search=parse(typed), **filters)]  # type: ignore[arg-type]


def test_each_form_finds_its_jobs(app: Harvest, clean_db: Engine) -> None:
    a = app.enqueue("echo", {"value": {"url": "https://x.org/a", "n": 5}}, delay=600).id
    b = app.enqueue("echo", {"value": {"url": "https://x.org/b", "n": "5"}}, delay=600).id
    c = app.enqueue("echo", {"value": ["https://x.org/a", 7]}, delay=600).id
    d = app.enqueue("noop", delay=600).id
    assert found(clean_db, str(b)) == [b]
    assert found(clean_db, f"id = {d}") == [d]
    assert found(clean_db, "name = echo") == [c, b, a]
    assert found(clean_db, "ECH") == [c, b, a]  # part of a name, any case
    assert found(clean_db, "%") == []  # a wildcard is only itself
    assert found(clean_db, "payload.value.url = https://x.org/a") == [a]
    assert found(clean_db, "payload.value.n = 5") == [a]
    assert found(clean_db, 'payload.value.n = "5"') == [b]
    assert found(clean_db, "payload.value = 7") == []  # a scalar is not an array's element
    assert found(clean_db, "payload.value = [7]") == [c]  # an array: holding all of these
    assert found(clean_db, "payload.value.url = https://x.org/a", status="failed") == []
    assert found(clean_db, "payload.value.url = https://x.org/b", state="scheduled") == [b]


def test_a_search_is_a_bound_parameter_never_sql(app: Harvest, clean_db: Engine) -> None:
    app.enqueue("echo", {"value": "x"})
    for typed in (
        "payload.value = x'); DELETE FROM harvest_jobs; --",
        "name = echo' OR '1'='1",
        "echo' OR true --",
        "'; DROP TABLE harvest_jobs; --",
        "payload.value\"}'::jsonb OR true; -- = 1",
    ):
        assert found(clean_db, typed) == []
    with clean_db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM harvest_jobs")).scalar_one() == 1


def test_a_payload_search_can_use_the_gin_index(app: Harvest, clean_db: Engine) -> None:
    with clean_db.begin() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        conn.execute(text("SET LOCAL enable_indexscan = off"))  # not the id walk
        plan = "\n".join(
            conn.execute(
                text(
                    "EXPLAIN SELECT id FROM harvest_jobs "
                    "WHERE payload @> CAST(:q AS jsonb) ORDER BY id DESC LIMIT 51"
                ),
                {"q": parse("payload.url = https://x").payload},
            ).scalars()
        )
    assert "harvest_jobs_payload_idx" in plan, plan


def test_the_cli_searches_with_an_option(
    migrated: Settings, app: Harvest, clean_db: Engine, redis_client: object
) -> None:
    from tests.integration.test_cli import Cli, base_env

    cli = Cli(
        base_env(HARVEST_DATABASE_URL=migrated.database_url, HARVEST_REDIS_URL=migrated.redis_url)
    )
    a = app.enqueue("echo", {"value": {"url": "https://x.org/a"}}, delay=600).id
    b = app.enqueue("echo", {"value": {"url": "https://x.org/b"}}, delay=600).id
    listing = cli.ok("jobs", "ls", "--search", "payload.value.url = https://x.org/b")
    assert f"│ {b} " in listing and f"│ {a} " not in listing
    assert "unknown field 'colour'" in cli.refused("jobs", "ls", "--search", "colour = red")
