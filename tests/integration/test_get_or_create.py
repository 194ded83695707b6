"""harvest.db.get_or_create under contention, on real OS processes and a real unique index."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import BigInteger, Engine, Identity, Integer, Text, create_engine, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.pool import NullPool

from harvest.db import get_or_create
from harvest.settings import Settings

PROCESSES = 100
NAMES = [f"name-{i:02d}" for i in range(20)]
# Postgres allows 100 connections in all, shared with other test runs: at most this many of the
# 100 processes hold one at a time. All of them are released together by one barrier.
CONNECTIONS = 30
PRELOAD = ["sqlalchemy", "psycopg", "harvest.db", "harvest.store", __name__]


class ScratchBase(DeclarativeBase):
    pass


class Thing(ScratchBase):
    __tablename__ = "test_goc_things"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(Text, unique=True)
    created_by: Mapped[int] = mapped_column(Integer)


class Note(ScratchBase):
    __tablename__ = "test_goc_notes"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    body: Mapped[str] = mapped_column(Text)


@pytest.fixture
def things(engine: Engine) -> Iterator[Engine]:
    with engine.begin() as conn:
        ScratchBase.metadata.drop_all(conn)
        ScratchBase.metadata.create_all(conn)
    yield engine
    with engine.begin() as conn:
        ScratchBase.metadata.drop_all(conn)


def forkserver() -> Any:
    """Real processes, forked from a clean server that imported SQLAlchemy once (spawning 100
    fresh interpreters would take most of a minute on two cores)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def contend(url: str, index: int, barrier: Any, gate: Any, results: Any) -> None:
    """One process: get_or_create every name, each in its own transaction."""
    try:
        engine = create_engine(url, poolclass=NullPool)
        got: dict[str, tuple[int, bool]] = {}
        barrier.wait(60)
        with gate, Session(engine) as session:
            for name in NAMES:
                with session.begin():
                    row, created = get_or_create(
                        session, Thing, lookup={"name": name}, defaults={"created_by": index}
                    )
                    got[name] = (row.id, created)
        engine.dispose()
        results.put((index, got, None))
    except BaseException as exc:
        results.put((index, None, f"{type(exc).__name__}: {exc}"))


@pytest.mark.slow
def test_hundred_processes_get_or_create_the_same_names(things: Engine, migrated: Settings) -> None:
    ctx = forkserver()
    barrier = ctx.Barrier(PROCESSES)
    gate = ctx.BoundedSemaphore(CONNECTIONS)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=contend, args=(migrated.database_url, i, barrier, gate, results))
        for i in range(PROCESSES)
    ]
    started = time.monotonic()
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[dict[str, tuple[int, bool]] | None, str | None]] = {}
    try:
        while len(outcomes) < PROCESSES:
            index, got, error = results.get(timeout=max(1.0, 90 - (time.monotonic() - started)))
            outcomes[index] = (got, error)
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()

    assert len(outcomes) == PROCESSES, f"only {len(outcomes)} processes reported"
    errors = [e for _, e in outcomes.values() if e is not None]
    assert not errors, errors[:5]
    assert all(p.exitcode == 0 for p in procs)

    with things.connect() as conn:
        rows = conn.execute(text("SELECT name, id FROM test_goc_things")).all()
    in_db = {r.name: r.id for r in rows}
    assert len(rows) == len(NAMES), "a name got more than one row"
    assert set(in_db) == set(NAMES)
    for name in NAMES:
        seen = {got[name][0] for got, _ in outcomes.values() if got is not None}
        assert seen == {in_db[name]}, f"callers got different ids for {name}: {seen}"
        creators = [got[name][1] for got, _ in outcomes.values() if got is not None]
        assert sum(creators) == 1, f"{sum(creators)} callers say they created {name}"


def _waiting_on_a_lock(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO test_goc_things%'"
                )
            ).scalar_one()
        )


def test_outer_transaction_survives_a_lost_race(things: Engine) -> None:
    """Work done before get_or_create in the same transaction is committed, also when the
    INSERT lost to a concurrent writer (IntegrityError inside the SAVEPOINT)."""
    outcome: dict[str, Any] = {}

    def loser() -> None:
        try:
            with Session(things) as session, session.begin():
                session.add(Note(body="before"))
                session.flush()
                row, created = get_or_create(
                    session, Thing, lookup={"name": "contested"}, defaults={"created_by": 2}
                )
                outcome["row"] = (row.id, created, row.created_by)
                session.add(Note(body="after"))
        except BaseException as exc:
            outcome["error"] = exc

    with things.connect() as winner:
        tx = winner.begin()
        winner_id = winner.execute(
            text(
                "INSERT INTO test_goc_things (name, created_by) "
                "VALUES ('contested', 1) RETURNING id"
            )
        ).scalar_one()
        thread = threading.Thread(target=loser)
        thread.start()
        deadline = time.monotonic() + 10
        while not _waiting_on_a_lock(things):
            assert thread.is_alive(), outcome
            assert time.monotonic() < deadline, "the loser never reached the unique index"
            time.sleep(0.02)
        tx.commit()
    thread.join(10)

    assert "error" not in outcome, outcome.get("error")
    assert outcome["row"] == (winner_id, False, 1)
    with things.connect() as conn:
        notes = conn.execute(select(Note.body).order_by(Note.id)).scalars().all()
        contested = conn.execute(
            text("SELECT count(*) FROM test_goc_things WHERE name = 'contested'")
        ).scalar_one()
    assert notes == ["before", "after"]
    assert contested == 1


def test_created_row_and_outer_work_commit_together(things: Engine) -> None:
    with Session(things) as session, session.begin():
        session.add(Note(body="with it"))
        row, created = get_or_create(
            session, Thing, lookup={"name": "fresh"}, defaults={"created_by": 7}
        )
        assert created
        row_id = row.id
    with Session(things) as session:
        again, created_again = get_or_create(session, Thing, lookup={"name": "fresh"})
        assert (again.id, again.created_by, created_again) == (row_id, 7, False)
        assert session.scalars(select(Note.body)).all() == ["with it"]


def test_outer_rollback_takes_the_created_row_with_it(things: Engine) -> None:
    with Session(things) as session:
        session.begin()
        session.add(Note(body="doomed"))
        get_or_create(session, Thing, lookup={"name": "doomed"}, defaults={"created_by": 1})
        session.rollback()
    with things.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM test_goc_things")).scalar_one() == 0
        assert conn.execute(text("SELECT count(*) FROM test_goc_notes")).scalar_one() == 0
