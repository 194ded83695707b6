"""Helpers shared by the in-process integration tests: claim and run jobs without Celery, count
what the test jobs did, and a broker that records what the dispatcher publishes."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, text

from harvest import store
from harvest.broker import Broker
from harvest.execution import sql
from harvest.jobs import Claimed
from harvest.models import JobStatus
from harvest.settings import Settings


def claim_all(engine: Engine) -> list[Claimed]:
    """Claim every due job (up to 100), as the dispatcher would before publishing them."""
    with engine.begin() as conn:
        return store.claim_due(conn, limit=100, ttl=300)


def body(claimed: list[Claimed]) -> list[list[Any]]:
    """The message a worker gets for ``claimed``: ``[[id, token], ...]``."""
    return [[c.id, str(c.token)] for c in claimed]


def statuses(engine: Engine, ids: list[int]) -> dict[str, int]:
    """How many of the jobs ``ids`` are in each status: ``{"succeeded": 3, ...}`` (wherever they
    are: the jobs table or the history)."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT status, count(*) FROM harvest_jobs_all WHERE id = ANY(:ids) GROUP BY status"
            ),
            {"ids": ids},
        ).all()
    return {r[0]: r[1] for r in rows}


def dispatched(engine: Engine, n: int) -> list[sql.Pair]:
    """``n`` jobs as a dispatcher leaves them (dispatched, leased for a minute): their ids and
    tokens, for the fenced writes of an attempt."""
    with engine.begin() as conn:
        rows = conn.execute(
            text(
                "INSERT INTO harvest_jobs (name, status, lease_token, dispatched_at, "
                "lease_expires_at) SELECT 'writer.test', 'dispatched', gen_random_uuid(), now(), "
                "now() + interval '60 seconds' FROM generate_series(1, :n) "
                "RETURNING id, lease_token"
            ),
            {"n": n},
        ).all()
    return [(int(r.id), uuid.UUID(str(r.lease_token))) for r in rows]


def succeeded(pair: sql.Pair) -> sql.Finish:
    """The fenced finish of ``pair``'s attempt as a success."""
    return sql.Finish(pair[0], pair[1], JobStatus.SUCCEEDED, result_json="1")


def effect_count(engine: Engine, job_id: int) -> int:
    """How many times a test job recorded its effect (in the ``effects`` fixture's table)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM test_effects WHERE job_id = :id"), {"id": job_id}
            ).scalar_one()
        )


class RecordingBroker(Broker):
    """Publishes nothing: records the ids of the jobs the dispatcher sends, in order."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.published: list[int] = []
        self.messages: list[list[int]] = []

    def publish_jobs(self, messages: Sequence[Sequence[Claimed]]) -> None:
        self.published += [job.id for message in messages for job in message]
        self.messages += [[job.id for job in message] for message in messages]

    def nudge_dispatch(self) -> None:
        pass


def statement_kinds(runner: Any, monkeypatch: Any) -> list[str]:
    """The execution statements ``runner`` sends from now on, by kind (hold, start, finish,
    finish+start, other), in order."""
    from harvest.execution import sql

    kinds = {sql._HOLD: "hold", sql._START: "start", sql._FINISH: "finish"}
    kinds[sql._FINISH_THEN_START] = "finish+start"
    sent: list[str] = []
    db = runner.sync.db

    def counted(query: Any) -> Any:
        sent.append(kinds.get(query.sql, "other"))
        return db(query)

    monkeypatch.setattr(runner.sync, "db", counted)
    return sent
