"""Enqueue in the caller's transaction (``connection=``): the job exists if and only if the
caller commits; the nudge goes out only after a commit; a rollback leaves nothing and sends
nothing. With a SQLAlchemy Session and Connection, and a psycopg connection."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from harvest.app import Harvest
from harvest.broker import Broker
from harvest.errors import InvalidOption, JobDepthFull
from harvest.models import JobStatus
from harvest.runner import Runner
from harvest.settings import Settings
from tests.helpers import body, claim_all


class CountingBroker(Broker):
    """Counts nudges instead of publishing them."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.nudges = 0
        self._lock = threading.Lock()

    def nudge_dispatch(self) -> None:
        with self._lock:
            self.nudges += 1


@pytest.fixture
def app(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Iterator[Harvest]:
    settings = migrated.model_copy(update={"nudge_coalesce_ms": 1})  # every nudge counts
    harvest = Harvest(settings, broker=CountingBroker(settings))
    harvest.load_imports(["tests.jobs"])
    yield harvest
    harvest.close()


def nudges(app: Harvest) -> int:
    broker = app.broker
    assert isinstance(broker, CountingBroker)
    return broker.nudges


def rows(engine: Engine) -> list[tuple[int, str]]:
    with engine.connect() as conn:
        found = conn.execute(text("SELECT id, name FROM harvest_jobs ORDER BY id")).all()
    return [(r[0], r[1]) for r in found]


def run_due(app: Harvest, runner: Runner, engine: Engine) -> None:
    claimed = claim_all(engine)
    assert claimed, "nothing was due"
    runner.execute(body(claimed))


def wait_past_coalescing() -> None:
    threading.Event().wait(0.01)  # nudges are coalesced per millisecond here


# --- SQLAlchemy Session ---------------------------------------------------------------------


def test_session_commit_stores_the_job_and_nudges_after_the_commit(
    app: Harvest, runner: Runner, clean_db: Engine
) -> None:
    with Session(clean_db) as session:
        session.execute(text("SELECT 1"))  # the caller's own work in the same transaction
        ref = app.enqueue("echo", {"value": 1}, connection=session)
        ids = app.enqueue_many("echo", [{"value": 2}, {"value": 3}], connection=session)
        assert rows(clean_db) == []  # not visible outside the transaction yet
        assert nudges(app) == 0  # nothing sent before the commit
        session.commit()
    assert [r[0] for r in rows(clean_db)] == [ref.id, *ids]
    assert nudges(app) == 1  # one nudge for the transaction, after its commit
    run_due(app, runner, clean_db)
    assert app.get(ref.id).status is JobStatus.SUCCEEDED


def test_session_rollback_leaves_no_job_and_sends_nothing(app: Harvest, clean_db: Engine) -> None:
    with Session(clean_db) as session:
        app.enqueue("echo", {"value": 1}, connection=session)
        app.enqueue_many("echo", [{"value": 2}], connection=session)
        session.rollback()
        wait_past_coalescing()
        session.execute(text("SELECT 1"))
        session.commit()  # a later transaction of the same session: still nothing to nudge
    assert rows(clean_db) == []
    assert nudges(app) == 0


def test_closing_a_session_without_commit_discards_the_job(app: Harvest, clean_db: Engine) -> None:
    with Session(clean_db) as session:
        app.enqueue("echo", {"value": 1}, connection=session)
    assert rows(clean_db) == []
    assert nudges(app) == 0


# --- SQLAlchemy Connection ------------------------------------------------------------------


def test_connection_commit_and_rollback(app: Harvest, runner: Runner, clean_db: Engine) -> None:
    with clean_db.connect() as conn:
        app.enqueue("echo", {"value": "rolled back"}, connection=conn)
        conn.rollback()
        assert nudges(app) == 0
        ref = app.enqueue("echo", {"value": "kept"}, connection=conn)  # begins a new one
        ids = app.enqueue_many("echo", [{"value": "kept too"}], connection=conn)
        assert rows(clean_db) == []
        conn.commit()
    assert [r[0] for r in rows(clean_db)] == [ref.id, *ids]
    assert nudges(app) == 1
    run_due(app, runner, clean_db)
    assert app.get(ref.id).status is JobStatus.SUCCEEDED
    assert app.get(ids[0]).status is JobStatus.SUCCEEDED


def test_an_autocommit_connection_is_refused(app: Harvest, clean_db: Engine) -> None:
    with clean_db.connect() as conn:
        auto = conn.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(InvalidOption, match="AUTOCOMMIT"):
            app.enqueue("echo", {}, connection=auto)
    assert rows(clean_db) == []


# --- psycopg ---------------------------------------------------------------------------------


def test_psycopg_commit_stores_the_job_rollback_leaves_nothing(
    app: Harvest, runner: Runner, clean_db: Engine, migrated: Settings
) -> None:
    with psycopg.connect(migrated.psycopg_url) as raw:
        app.enqueue("echo", {"value": "rolled back"}, connection=raw)
        app.enqueue_many("echo", [{"value": "rolled back"}] * 3, connection=raw)
        raw.rollback()
        assert rows(clean_db) == []
        ref = app.enqueue("echo", {"value": "kept"}, connection=raw)
        ids = app.enqueue_many("echo", [{"value": i} for i in range(3)], connection=raw)
        raw.execute("SELECT 1")  # the caller's connection is still theirs, in the transaction
        assert rows(clean_db) == []
        raw.commit()
        assert not raw.closed  # harvest never closes it
    assert [r[0] for r in rows(clean_db)] == [ref.id, *ids]
    # A psycopg connection has no commit hook: nothing is sent (beat finds the jobs, or the
    # caller calls app.nudge() after its commit).
    assert nudges(app) == 0
    run_due(app, runner, clean_db)
    assert {app.get(i).status for i in [ref.id, *ids]} == {JobStatus.SUCCEEDED}


def test_psycopg_in_a_transaction_block_and_autocommit_outside_one(
    app: Harvest, clean_db: Engine, migrated: Settings
) -> None:
    with psycopg.connect(migrated.psycopg_url, autocommit=True) as raw:
        with pytest.raises(InvalidOption, match="autocommit"):
            app.enqueue("echo", {}, connection=raw)
        with raw.transaction():
            ref = app.enqueue("echo", {"value": 1}, connection=raw)
        with pytest.raises(RuntimeError), raw.transaction():
            app.enqueue("echo", {"value": 2}, connection=raw)
            raise RuntimeError("the caller's block fails: its transaction rolls back")
    assert [r[0] for r in rows(clean_db)] == [ref.id]


def test_psycopg_with_its_own_row_factory(
    app: Harvest, clean_db: Engine, migrated: Settings
) -> None:
    from psycopg.rows import dict_row

    with psycopg.connect(migrated.psycopg_url, row_factory=dict_row) as raw:
        ref = app.enqueue("echo", {"value": 1}, connection=raw, idempotency_key="k-1")
        again = app.enqueue("echo", {"value": 1}, connection=raw, idempotency_key="k-1")
        row: Any = raw.execute("SELECT count(*) AS n FROM harvest_jobs").fetchone()
        assert row == {"n": 1}  # the caller's row factory is untouched
    assert (again.id, again.created) == (ref.id, False)
    assert [r[0] for r in rows(clean_db)] == [ref.id]


# --- backpressure and idempotency inside the caller's transaction ----------------------------


@pytest.mark.parametrize("kind", ["session", "connection", "psycopg"])
def test_backpressure_and_idempotency_inside_the_callers_transaction(
    app: Harvest, clean_db: Engine, migrated: Settings, kind: str
) -> None:
    """``limited`` allows 5 pending jobs. The 6th is refused in a SAVEPOINT: the caller's
    transaction goes on, and what it did before and after is committed."""
    with _connection(kind, clean_db, migrated) as (conn, commit):
        first = app.enqueue("limited", {"value": 0}, connection=conn, idempotency_key="same")
        again = app.enqueue("limited", {"value": 0}, connection=conn, idempotency_key="same")
        assert (again.id, again.created) == (first.id, False)
        more = app.enqueue_many("limited", [{"value": i} for i in range(10)], connection=conn)
        assert len(more) == 4  # as many as fit
        with pytest.raises(JobDepthFull):
            app.enqueue("limited", {"value": 99}, connection=conn)
        extra = app.enqueue("echo", {"value": "after the refusal"}, connection=conn)
        commit()
    names = [name for _, name in rows(clean_db)]
    assert names.count("limited") == 5
    assert rows(clean_db)[-1] == (extra.id, "echo")


class _connection:
    """A caller's connection of each kind, and how it commits."""

    def __init__(self, kind: str, engine: Engine, settings: Settings) -> None:
        self.kind, self.engine, self.settings = kind, engine, settings

    def __enter__(self) -> tuple[Any, Any]:
        if self.kind == "session":
            self.handle: Any = Session(self.engine)
        elif self.kind == "connection":
            self.handle = self.engine.connect()
        else:
            self.handle = psycopg.connect(self.settings.psycopg_url)
        return self.handle, self.handle.commit

    def __exit__(self, *exc: object) -> None:
        self.handle.close()
