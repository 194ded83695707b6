"""A prefork process's message of short sync jobs: their starts and their ends share statements
(harvest.execution.run_ahead), each write still fenced alone, and a message that ends early
leaves nothing to rescue that it could have written or handed back."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, text

from harvest.app import Harvest
from harvest.context import JobContext
from harvest.jobs import Claimed
from harvest.models import JobStatus
from harvest.runner import Runner
from tests.helpers import claim_all, statement_kinds

# A write linger of 20 ms (2 by default): on a busy machine a wait of 2 ms for the next job
# can end before it does, and the statements these tests expect would be split.
LINGER = {"write_linger_ms": 20.0}


@pytest.fixture
def app(jobs_app: Callable[..., Harvest]) -> Harvest:
    return jobs_app(LINGER)


def body(claimed: list[Claimed]) -> list[list[Any]]:
    """The message as the dispatcher sends it: ``[[id, token, name], ...]``."""
    return [[c.id, str(c.token), c.name] for c in claimed]


def rows(engine: Engine, ids: list[int]) -> list[Any]:
    with engine.connect() as conn:
        found = conn.execute(
            text(
                "SELECT id, status, attempts, started_at, finished_at FROM harvest_jobs_all "
                "WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        ).all()
    by_id = {r.id: r for r in found}
    return [by_id[i] for i in ids]


def enqueue_in_order(app: Harvest, name: str, n: int) -> list[int]:
    """``n`` jobs of ``name`` that a claim takes in the order they were made."""
    return [app.enqueue(name, {"n": i}, priority=1000 - i).id for i in range(n)]


def run_message(app: Harvest, runner: Runner, engine: Engine) -> dict[str, int]:
    return runner.execute(body(claim_all(engine)))


@pytest.fixture
def quick(app: Harvest, runner: Runner, effects: Engine) -> list[int]:
    """A job ``quick`` whose handler this process has seen run (in well under the write
    linger), and one ``first_of_its_name`` it has not: what ``quick`` runs from now on, in
    order."""
    ran: list[int] = []

    @app.job("quick")
    def quick(ctx: JobContext, n: int) -> int:
        ran.append(n)
        return n

    @app.job("first_of_its_name")
    def first_of_its_name(ctx: JobContext, n: int) -> int:
        return n

    enqueue_in_order(app, "quick", 2)
    assert run_message(app, runner, effects)["started"] == 2  # its run time is known now
    ran.clear()
    return ran


def test_a_message_of_short_jobs_starts_them_together_and_ends_them_together(
    app: Harvest,
    runner: Runner,
    effects: Engine,
    monkeypatch: pytest.MonkeyPatch,
    quick: list[int],
) -> None:
    """Once this process has seen the job's handler run in well under the write linger, a
    message of six: all held and started in one write, all ended in one. Two statements
    where eleven were; each job ran once and succeeded."""
    ids = enqueue_in_order(app, "quick", 6)
    sent = statement_kinds(runner, monkeypatch)
    assert run_message(app, runner, effects)["started"] == 6
    assert sent == ["start", "finish"]
    assert quick == list(range(6))
    ended = rows(effects, ids)
    assert {(r.status, r.attempts) for r in ended} == {("succeeded", 1)}
    assert len({r.started_at for r in ended}) == 1  # one statement each
    assert len({r.finished_at for r in ended}) == 1


def test_a_window_of_short_jobs_starts_with_the_end_of_the_job_before(
    app: Harvest,
    runner: Runner,
    effects: Engine,
    monkeypatch: pytest.MonkeyPatch,
    quick: list[int],
) -> None:
    """A job of unknown run time first, then short ones: the first is held and started in one
    write, the others held; the first's end goes with the others' starts, their ends in one."""
    first = app.enqueue("first_of_its_name", {"n": 0}).id
    ids = enqueue_in_order(app, "quick", 5)
    claimed = claim_all(effects)
    by_name = [c for c in claimed if c.id == first] + [c for c in claimed if c.id != first]
    sent = statement_kinds(runner, monkeypatch)
    assert runner.execute(body(by_name))["started"] == 6
    assert sent == ["start", "hold", "finish+start", "finish"]
    ended = rows(effects, [first, *ids])
    assert {(r.status, r.attempts) for r in ended} == {("succeeded", 1)}
    assert {r.started_at for r in ended[1:]} == {ended[0].finished_at}
    assert len({r.finished_at for r in ended[1:]}) == 1


def test_jobs_slower_than_the_write_linger_are_started_one_at_a_time(
    app: Harvest, runner: Runner, effects: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler of 30 ms (the write linger is 20 ms): no job is started before the one before
    it ends, and no end waits for the next job: the first held and started in one write, then
    'end one, start the next' a job."""
    import time

    @app.job("slowish")
    def slowish(ctx: JobContext, n: int) -> int:
        time.sleep(0.03)
        return n

    enqueue_in_order(app, "slowish", 1)
    run_message(app, runner, effects)
    ids = enqueue_in_order(app, "slowish", 4)
    sent = statement_kinds(runner, monkeypatch)
    assert run_message(app, runner, effects)["started"] == 4
    assert sent == ["start", "hold", *["finish+start"] * 3, "finish"]
    ended = rows(effects, ids)
    for before, after in itertools.pairwise(ended):
        assert after.started_at == before.finished_at


def test_a_message_that_ends_early_writes_its_ends_and_hands_back_what_it_started_ahead(
    app: Harvest, runner: Runner, effects: Engine
) -> None:
    """The process is told to stop (SystemExit, as billiard raises on SIGTERM in a prefork
    child) while the third of five short jobs runs: the second's end, waiting to share a
    statement, is written; the fourth and fifth, started ahead and never run, are pending
    again with no attempt counted; the third stays running for rescue, as a job cut by a
    dying worker does."""
    stop_at: list[int] = []

    @app.job("stoppable")
    def stoppable(ctx: JobContext, n: int) -> int:
        if n in stop_at:
            raise SystemExit(0)
        return n

    enqueue_in_order(app, "stoppable", 2)
    run_message(app, runner, effects)
    ids = enqueue_in_order(app, "stoppable", 5)
    stop_at.append(2)
    with pytest.raises(SystemExit):
        run_message(app, runner, effects)
    after = [(r.status, r.attempts) for r in rows(effects, ids)]
    assert after == [
        ("succeeded", 1),
        ("succeeded", 1),
        ("running", 1),
        (JobStatus.PENDING.value, 0),
        (JobStatus.PENDING.value, 0),
    ]


def test_an_end_does_not_wait_for_a_job_that_was_not_started_with_it(
    app: Harvest,
    runner: Runner,
    effects: Engine,
    monkeypatch: pytest.MonkeyPatch,
    quick: list[int],
) -> None:
    """A window of two short jobs, the second cancelled before the window starts: the first's
    end, waiting for the second (which does not run), is written before the slow job after
    them starts, not with that job's end 30 ms later."""
    import time

    @app.job("slowish")
    def slowish(ctx: JobContext, n: int) -> int:
        time.sleep(0.03)
        return n

    enqueue_in_order(app, "slowish", 1)
    run_message(app, runner, effects)  # its run time known now too
    first = app.enqueue("first_of_its_name", {"n": 0}, priority=1000).id
    q1, q2 = (app.enqueue("quick", {"n": n}, priority=999 - n).id for n in (1, 2))
    slow = app.enqueue("slowish", {"n": 3}, priority=990).id
    claimed = claim_all(effects)
    assert [c.id for c in claimed] == [first, q1, q2, slow]
    app.cancel(q2)
    sent = statement_kinds(runner, monkeypatch)
    assert runner.execute(body(claimed))["started"] == 3
    assert sent == ["start", "hold", "finish+start", "finish", "start", "finish"]
    _, b, c, d = rows(effects, [first, q1, q2, slow])
    assert (b.status, c.status, d.status) == ("succeeded", "cancelled", "succeeded")
    assert b.finished_at < d.started_at


def test_a_job_twice_in_one_message_runs_once(
    app: Harvest, runner: Runner, effects: Engine, quick: list[int]
) -> None:
    """A message that lists a short job twice (a dispatcher never sends one, a hand-made or
    replayed message may): the job runs once; the second listing is suppressed."""
    ids = enqueue_in_order(app, "quick", 3)
    claimed = claim_all(effects)
    message = body([claimed[0], claimed[1], claimed[1], claimed[2]])
    counts = runner.execute(message)
    assert (counts["started"], counts["suppressed"]) == (3, 1)
    assert quick == [0, 1, 2]
    assert {(r.status, r.attempts) for r in rows(effects, ids)} == {("succeeded", 1)}


# --- short jobs with a key ------------------------------------------------------------------


@pytest.fixture
def keyed(jobs_app: Callable[..., Harvest], redis_client: Any) -> Harvest:
    """An app whose pool "p" has one key (at most one call at once, no rate limit: a lease of
    it may pass from job to job), and a job ``keyed`` of it, its run time known to the
    process."""
    from cryptography.fernet import Fernet
    from pydantic import SecretStr

    from harvest import keystore

    secret = SecretStr(Fernet.generate_key().decode())
    app = jobs_app({**LINGER, "secret_key": secret, "key_wait": 0.5})
    cipher = keystore.Cipher.from_settings(app.settings)
    with app.sessions.begin() as session:
        keystore.add_key(session, cipher, pool="p", name="only", secret="sk-window-0123456789")
    keystore.sync_pool(app.engine, redis_client, "p")
    return app


def keyed_job(app: Harvest, runner: Runner, effects: Engine) -> tuple[list[int], list[int]]:
    """Register ``keyed`` (it answers 429 for the payloads in the second list, and stops the
    process, as billiard's SIGTERM does in a prefork child, for those in the third) and
    ``keyed_lead``, of the same pool; warm ``keyed`` up: what they run from now on, in order."""
    ran: list[int] = []
    limited: list[int] = []

    @app.job("keyed", pool="p", max_attempts=3)
    def keyed(ctx: JobContext, n: int) -> int:
        assert ctx.key == "sk-window-0123456789"
        ran.append(n)
        if n in limited:
            ctx.rate_limited(30)
        if -n in limited:
            raise SystemExit(0)
        return n

    @app.job("keyed_lead", pool="p")
    def keyed_lead(ctx: JobContext, n: int) -> int:
        ran.append(n)
        return n

    ids = enqueue_in_order(app, "keyed", 8)  # a first run may be slow: 7 more
    assert run_message(app, runner, effects)["started"] == 8
    assert {r.status for r in rows(effects, ids)} == {"succeeded"}
    ran.clear()
    return ran, limited


def key_state(app: Harvest) -> tuple[str, int]:
    from harvest.coordination.key_pool import KeyPool

    (state,) = KeyPool(app.redis, "p").snapshot()
    return state.status, state.live_leases


def keyed_message(app: Harvest, lead: bool, n: int) -> tuple[list[int], list[list[Any]]]:
    """``n`` short ``keyed`` jobs (payloads 0..n-1), led (``lead``) by a ``keyed_lead`` job of
    payload 100 whose run time this process does not know yet; their ids and the message."""
    first = [app.enqueue("keyed_lead", {"n": 100}).id] if lead else []
    ids = first + enqueue_in_order(app, "keyed", n)
    claimed = {c.id: c for c in claim_all(app.engine)}
    return ids, body([claimed[i] for i in ids])


LEADS = pytest.mark.parametrize(
    "lead",
    [False, True],
    ids=["key-leased-before-the-hold", "key-passed-at-the-end-of-a-job-before"],
)


@LEADS
def test_a_window_of_short_keyed_jobs_shares_its_writes_and_its_key(
    keyed: Harvest, effects: Engine, monkeypatch: pytest.MonkeyPatch, lead: bool
) -> None:
    """Short jobs of one pool whose key may pass from job to job: the first takes the key (a
    lease before its hold, which is then its start; or, after a job whose run time is not
    known, the key that job gives back), the rest start in the same statement and run one
    after another on that key, lent along the window; their ends go in one statement. The key
    was never held twice (one key, one call at most: the handler would not have got it) and is
    free after."""
    runner = Runner(keyed)
    try:
        ran, _ = keyed_job(keyed, runner, effects)
        ids, message = keyed_message(keyed, lead, 6)
        sent = statement_kinds(runner, monkeypatch)
        assert runner.execute(message)["started"] == len(ids)
    finally:
        runner.close()
    # (the ends go in one statement; a stall of the machine past the linger may split them)
    starts = ["start", "hold", "finish+start"] if lead else ["start"]
    assert sent[: len(starts)] == starts and set(sent[len(starts) :]) == {"finish"}, sent
    assert ran == [100] * lead + list(range(6))
    ended = rows(effects, ids)
    assert {(r.status, r.attempts) for r in ended} == {("succeeded", 1)}
    window = ended[1:] if lead else ended
    assert len({r.started_at for r in window}) == 1
    assert key_state(keyed) == ("active", 0)


@LEADS
def test_a_429_in_a_keyed_window_cools_the_key_and_hands_the_rest_back_unrun(
    keyed: Harvest, effects: Engine, lead: bool
) -> None:
    """The third short job of a window answers 429: the key goes back to Redis and cools; the
    jobs after it, started with it on that key, never run: they are pending again with no
    attempt counted. The jobs before it succeeded; it waits to retry on its attempt."""
    runner = Runner(keyed)
    try:
        ran, limited = keyed_job(keyed, runner, effects)
        ids, message = keyed_message(keyed, lead, 6)
        limited.append(2)
        counts = runner.execute(message)
    finally:
        runner.close()
    assert ran == [100] * lead + [0, 1, 2]
    assert counts["deferred"] == 3
    after = [(r.status, r.attempts) for r in rows(effects, ids)][lead:]
    assert after[:2] == [("succeeded", 1), ("succeeded", 1)]
    assert after[2][0] == JobStatus.PENDING.value
    assert after[3:] == [(JobStatus.PENDING.value, 0)] * 3
    assert key_state(keyed) == ("cooling", 0)


@LEADS
def test_a_keyed_window_that_ends_early_gives_its_key_back_at_once(
    keyed: Harvest, effects: Engine, lead: bool
) -> None:
    """The process is told to stop while the third short job of a keyed window runs: the key
    goes back to Redis now (not when its lease expires), once; the jobs lent it after the third
    are pending again with no attempt counted; the third stays running for rescue."""
    runner = Runner(keyed)
    try:
        _, limited = keyed_job(keyed, runner, effects)
        ids, message = keyed_message(keyed, lead, 6)
        limited.append(-2)
        with pytest.raises(SystemExit):
            runner.execute(message)
        assert key_state(keyed) == ("active", 0)
    finally:
        runner.close()
    after = [(r.status, r.attempts) for r in rows(effects, ids)][lead:]
    assert after[:3] == [("succeeded", 1), ("succeeded", 1), ("running", 1)]
    assert after[3:] == [(JobStatus.PENDING.value, 0)] * 3
