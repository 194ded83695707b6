"""Fallback pools against the real Postgres and Redis, run in-process by the worker's Runner
(sync and async handlers): the second pool serves while the first pool's keys are all disabled
or cooling, with no attempt used; the first serves again once it is back; dispatch counts the
pools together."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis
from cryptography.fernet import Fernet
from pydantic import SecretStr
from redis.asyncio import Redis as AsyncRedis
from sqlalchemy import Engine, text

from harvest import dispatcher, keystore, store
from harvest.app import Harvest
from harvest.coordination import keys as keys_module
from harvest.coordination.key_pool import AsyncKeyPool, Busy, KeyPool, Lease
from harvest.execution import handoff, sql
from harvest.gate import AsyncGate
from harvest.models import JobStatus
from harvest.runner import Runner
from harvest.settings import Settings
from tests.helpers import RecordingBroker, body, claim_all, statement_kinds

FIRST, SECOND = "fb-first", "fb-second"
KEYS = {FIRST: ("a1", "a2"), SECOND: ("b1",)}


@pytest.fixture
def app(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Iterator[Harvest]:
    settings = migrated.model_copy(
        update={"secret_key": SecretStr(Fernet.generate_key().decode()), "key_wait": 1.0}
    )
    harvest = Harvest(settings, broker=RecordingBroker(settings), redis_client=redis_client)
    harvest.load_imports(["tests.jobs_fallback"])
    cipher = keystore.Cipher.from_settings(settings)
    with harvest.sessions.begin() as session:
        for pool, names in KEYS.items():
            for name in names:
                secret = f"sk-{pool}-{name}-0123456789"
                keystore.add_key(
                    session, cipher, pool=pool, name=name, secret=secret, max_concurrency=2
                )
    for pool in KEYS:
        keystore.sync_pool(harvest.engine, redis_client, pool)
    yield harvest
    harvest.close()


def _set_status(app: Harvest, status: str) -> None:
    """Every key of the first pool to ``status``, as ``harvest keys disable/enable`` does."""
    with app.engine.begin() as conn:
        for name in KEYS[FIRST]:
            keystore.set_status(conn, (FIRST, name), status)  # type: ignore[arg-type]
    keystore.sync_pool(app.engine, app.redis, FIRST)


def _key_ids(app: Harvest) -> list[int]:
    with app.engine.connect() as conn:
        return [k.id for k in keystore.list_keys(conn, FIRST)]


def disable(app: Harvest) -> Callable[[], None]:
    _set_status(app, "disabled")
    return lambda: _set_status(app, "active")


def cool(app: Harvest) -> Callable[[], None]:
    """Every key of the first pool cooling for a minute (a 429 each)."""
    pool = KeyPool(app.redis, FIRST)
    for key_id in _key_ids(app):
        assert pool.cooldown(key_id, 60.0) is not None

    def back() -> None:
        for key_id in _key_ids(app):
            pool.end_cooldown(key_id)

    return back


def run(app: Harvest, runner: Runner, name: str, n: int) -> list[store.Job]:
    ids = app.enqueue_many(name, [{}] * n)
    counts = runner.execute(body(claim_all(app.engine)))
    assert counts["started"] == n, counts
    with app.engine.connect() as conn:
        return [job for i in ids if (job := store.get(conn, i)) is not None]


@pytest.mark.parametrize("name", ["fallback_call", "async_fallback_call"])
@pytest.mark.parametrize("outage", [disable, cool])
def test_the_second_pool_serves_while_the_first_is_out_and_the_first_when_it_is_back(
    app: Harvest, runner: Runner, name: str, outage: Callable[[Harvest], Callable[[], None]]
) -> None:
    assert {job.result["pool"] for job in run(app, runner, name, 3)} == {FIRST}
    back = outage(app)
    # A key lease given back a moment ago may still pass to a job of this process for
    # PASS_FOR after its grant (as a job that had leased it just before would still call).
    time.sleep(handoff.PASS_FOR)
    jobs = run(app, runner, name, 6)
    assert {job.status for job in jobs} == {JobStatus.SUCCEEDED}
    assert {job.result["pool"] for job in jobs} == {SECOND}  # ctx.pool
    assert {job.attempts for job in jobs} == {1}  # falling back used no attempt
    back()
    jobs = run(app, runner, name, 4)  # as many as the first pool's keys take at once
    assert {job.result["pool"] for job in jobs} == {FIRST}
    assert {job.attempts for job in jobs} == {1}


def test_a_keyed_jobs_end_and_the_next_ones_start_go_in_one_statement(
    app: Harvest, runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next job of a message takes its key while the one before ends (that one's key is
    already given back), then starts in the same statement as that end."""
    sent = statement_kinds(runner, monkeypatch)
    jobs = run(app, runner, "fallback_call", 4)
    assert {(job.status, job.attempts, job.result["pool"]) for job in jobs} == {
        (JobStatus.SUCCEEDED, 1, FIRST)
    }
    assert sent == ["hold", "start", *["finish+start"] * 3, "finish"]


def _limit_rate(app: Harvest, rate: str | None) -> None:
    if rate is not None:
        with app.engine.begin() as conn:
            conn.execute(
                text("UPDATE harvest_api_keys SET rate_limit = :r WHERE pool = :p"),
                {"r": rate, "p": FIRST},
            )
        keystore.sync_pool(app.engine, app.redis, FIRST)


def _spy_pool(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each lease ("lease"), release ("release") and release-then-lease ("release+lease") the
    sync shell asks Redis for."""
    calls: list[str] = []
    for name, label in (("lease", "lease"), ("release", "release"),
                        ("release_then_lease", "release+lease")):  # fmt: skip
        real = getattr(KeyPool, name)

        def spy(
            self: KeyPool, *args: Any, _real: Any = real, _label: str = label, **kw: Any
        ) -> Any:
            calls.append(_label)
            return _real(self, *args, **kw)

        monkeypatch.setattr(KeyPool, name, spy)
    return calls


@pytest.mark.parametrize("rate", [None, "6000/m"])
def test_a_keyed_jobs_key_passes_to_the_next_job_or_goes_back_with_its_lease_in_one_round_trip(
    app: Harvest, runner: Runner, monkeypatch: pytest.MonkeyPatch, rate: str | None
) -> None:
    """In a message of keyed jobs, a key bound by its concurrency alone passes from each job
    to the next one of the message, with no Redis round trip: 2 for 4 jobs (the first lease,
    the last release), one lease (one fence) for them all. A key with a rate limit counts
    every call: each job's key is given back in the round trip of the next job's lease (two
    scripts pipelined, the release first), 5 round trips, a lease (a fence) a job, and the
    key's rate window holds a grant a job. No lease is left when the message is done."""
    monkeypatch.setattr(handoff, "PASS_FOR", 2.0)  # longer than a loaded machine takes
    _limit_rate(app, rate)
    calls = _spy_pool(monkeypatch)
    jobs = run(app, runner, "fallback_call", 4)
    assert {(job.status, job.attempts, job.result["pool"]) for job in jobs} == {
        (JobStatus.SUCCEEDED, 1, FIRST)
    }
    keys = {job.result["key_id"] for job in jobs}
    _no_lease_left(app, (FIRST,))  # (a key that may pass waits PARK for a next message)
    if rate is None:
        assert calls == ["lease", "release"]
        assert len(keys) == 1  # the one lease, passed on
    else:
        assert calls == ["lease", *["release+lease"] * 3, "release"]
        grants = sum(int(app.redis.zcard(f"{prefix}rate:{k}")) for k in _key_ids(app)
                     for prefix in [keys_module.pool_prefix(FIRST)])  # fmt: skip
        assert grants == 4


@pytest.mark.parametrize("rate", [None, "6000/m"])
def test_a_keyed_jobs_key_passes_to_the_first_job_of_the_next_message_that_comes_soon_after(
    app: Harvest, runner: Runner, monkeypatch: pytest.MonkeyPatch, rate: str | None
) -> None:
    """Sync keyed jobs, messages one after another as a prefork child runs them. A key bound
    by its concurrency alone, given back by a message's last job, waits in the process a
    moment (``PARK``) and passes to the next message's first job as it is: three messages of
    4 jobs ask Redis for one lease and give it back once, after the last, when no job took
    it. A key with a rate limit counts every call: a lease a job, none kept."""
    monkeypatch.setattr(handoff, "PARK", 1.0)  # longer than a loaded machine takes
    monkeypatch.setattr(handoff, "PASS_FOR", 2.0)
    _limit_rate(app, rate)
    calls = _spy_pool(monkeypatch)
    jobs = [job for _ in range(3) for job in run(app, runner, "fallback_call", 4)]
    assert {(job.status, job.attempts) for job in jobs} == {(JobStatus.SUCCEEDED, 1)}
    if rate is None:
        assert calls == ["lease"], calls  # the key is still kept for a next message
        assert len({job.result["key_id"] for job in jobs}) == 1
    _no_lease_left(app, (FIRST,))
    if rate is None:
        assert calls == ["lease", "release"], calls  # back to Redis once no job took it
    else:
        assert calls.count("lease") + calls.count("release+lease") == 12, calls


def test_a_key_kept_for_a_next_message_goes_back_to_redis_when_the_process_stops(
    app: Harvest, runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that stops (warm shutdown) gives back the key it kept for a next message at
    once, not when the key's wait or its lease runs out."""
    monkeypatch.setattr(handoff, "PARK", 60.0)
    monkeypatch.setattr(handoff, "PASS_FOR", 2.0)
    jobs = run(app, runner, "fallback_call", 2)
    assert {(job.status, job.attempts) for job in jobs} == {(JobStatus.SUCCEEDED, 1)}
    assert sum(k.live_leases for k in KeyPool(app.redis, FIRST).snapshot()) == 1  # kept
    runner.shutdown(grace=0.0)
    assert sum(k.live_leases for k in KeyPool(app.redis, FIRST).snapshot()) == 0


def _spy_async_pool(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each lease script call ("lease", one a call, then "granted" for each lease it gave),
    each key sent back ("release", one a lease) and each hand-off ("release+lease") the async
    shell asks Redis for."""
    calls: list[str] = []
    for name, label in (("lease_each", "lease"), ("release_each", "release"),
                        ("release_then_lease", "release+lease")):  # fmt: skip
        real = getattr(AsyncKeyPool, name)

        async def spy(
            self: AsyncKeyPool, *args: Any, _real: Any = real, _label: str = label, **kw: Any
        ) -> Any:
            released = len(args[0]) if _label == "release" else 1  # release_each: a list
            calls.extend([_label] * released)
            result = await _real(self, *args, **kw)
            if _label == "lease":
                calls.extend("granted" for x in result if isinstance(x, Lease))
            return result

        monkeypatch.setattr(AsyncKeyPool, name, spy)
    return calls


def _no_lease_left(app: Harvest, pools: tuple[str, ...] = (FIRST, SECOND)) -> None:
    """Every key lease is back in Redis within a second (a lease that may pass on waits
    ``handoff.PARK`` for the next job of its pool first)."""
    deadline = time.monotonic() + 1.0 + handoff.PARK
    while True:
        left = [k.live_leases for pool in pools for k in KeyPool(app.redis, pool).snapshot()]
        if not any(left) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not any(left), f"leases left: {left}"


@pytest.mark.parametrize("rate", [None, "6000/m"])
def test_an_async_job_waiting_for_a_key_gets_it_as_it_is_freed(
    app: Harvest, runner: Runner, monkeypatch: pytest.MonkeyPatch, rate: str | None
) -> None:
    """More async jobs at once than the first pool has slots (8 for 4 at most): the jobs
    that arrive together try a pool together, in one script; those that find every key busy
    wait, and a job of the same process that gives a key back hands it to the longest waiter.
    A key bound by its concurrency alone passes as it is, with no Redis round trip; one with
    a rate limit goes back in the round trip that leases for the waiter (release, then
    lease). Every job runs once, on an attempt of its own, and no lease is left."""
    monkeypatch.setattr(handoff, "PASS_FOR", 2.0)  # longer than a loaded machine takes
    _limit_rate(app, rate)
    calls = _spy_async_pool(monkeypatch)
    jobs = run(app, runner, "async_first_only", 8)
    assert {(job.status, job.attempts) for job in jobs} == {(JobStatus.SUCCEEDED, 1)}
    assert calls.count("lease") < 8, f"8 jobs that arrived together tried one by one: {calls}"
    _no_lease_left(app)
    if rate is None:
        assert "release+lease" not in calls, calls
        assert calls.count("release") == 4, f"a key per lease, not per job: {calls}"
    else:
        assert "release+lease" in calls
        assert calls.count("release") + calls.count("release+lease") == 8  # a key back a job


@pytest.mark.parametrize("rate", [None, "6000/m"])
def test_an_async_jobs_key_passes_to_a_job_of_its_pool_that_comes_soon_after(
    app: Harvest, runner: Runner, monkeypatch: pytest.MonkeyPatch, rate: str | None
) -> None:
    """Two messages of async jobs of one pool, one after the other. A key bound by its
    concurrency alone, given back by a job of the first, waits in the process a moment
    (``PARK``) and passes to a job of the second as it is: the second message's jobs lease
    nothing from Redis, the pool grants 4 leases (4 fences) for the 8 jobs, and the keys go
    back once no job has taken them. A key with a rate limit counts every call: a lease a job."""
    monkeypatch.setattr(handoff, "PARK", 1.0)  # longer than a loaded machine takes
    monkeypatch.setattr(handoff, "PASS_FOR", 2.0)
    _limit_rate(app, rate)
    calls = _spy_async_pool(monkeypatch)
    first = run(app, runner, "async_first_only", 4)
    second = run(app, runner, "async_first_only", 4)
    assert {(job.status, job.attempts) for job in first + second} == {(JobStatus.SUCCEEDED, 1)}
    _no_lease_left(app)
    if rate is None:
        assert calls.count("lease") == 1, calls  # the first message's, in one script
        assert calls.count("granted") == 4
    else:
        assert calls.count("granted") == 8


def test_an_async_job_that_finds_its_key_at_once_is_held_and_started_in_one_write(
    app: Harvest, runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An async job of one pool tries its key before its hold: with a key, its start is its
    hold (one row write); without (8 jobs for 4 slots), the rest are held and wait at the gate
    as before. The same message again is suppressed, each job giving back the key it took;
    every job ran once."""
    written: list[str] = []
    kinds = {sql._HOLD: "hold", sql._START: "start", sql._FINISH: "finish"}
    real = sql.arun

    async def counted(conn: Any, query: sql.Query[Any]) -> Any:
        written.extend([kinds.get(query.sql, "other")] * len(query.params.get("ids", [1])))
        return await real(conn, query)

    monkeypatch.setattr(sql, "arun", counted)

    def named_run(n: int) -> tuple[list[list[Any]], list[store.Job]]:
        ids = app.enqueue_many("async_first_only", [{}] * n)
        message = [[c.id, str(c.token), c.name] for c in claim_all(app.engine)]
        assert runner.execute(message)["started"] == n
        with app.engine.connect() as conn:
            return message, [job for i in ids if (job := store.get(conn, i)) is not None]

    message, jobs = named_run(4)
    assert {(job.status, job.attempts) for job in jobs} == {(JobStatus.SUCCEEDED, 1)}
    assert "hold" not in written and written.count("start") == 4, written
    assert runner.execute(message)["suppressed"] == 4
    _no_lease_left(app, (FIRST,))
    written.clear()
    _, jobs = named_run(8)
    assert {(job.status, job.attempts) for job in jobs} == {(JobStatus.SUCCEEDED, 1)}
    assert 1 <= written.count("hold") <= 4 and written.count("start") == 8, written
    _no_lease_left(app, (FIRST,))


def test_async_jobs_waiting_for_their_only_pool_get_keys_freed_elsewhere_with_one_try_a_poll(
    app: Harvest, runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every slot of the first pool is held by someone else (another process) for 0.6 s: the
    8 jobs of this pool alone wait in line, and one lease try every poll serves the whole line
    (a try per waiting job would be 8 every 0.25 s). When the keys are freed there, with no
    job of this process to hand them over, the first in line gets one, then the next at once;
    every job runs once, on its first attempt, and no lease is left."""
    calls: list[int] = []
    real = AsyncKeyPool.lease_each

    async def spy(self: AsyncKeyPool, holders: Any, *args: Any, **kw: Any) -> Any:
        calls.append(len(holders))
        return await real(self, holders, *args, **kw)

    monkeypatch.setattr(AsyncKeyPool, "lease_each", spy)
    pool = KeyPool(app.redis, FIRST)
    held = [pool.lease("elsewhere", 30.0) for _ in range(4)]
    freeing = threading.Timer(0.6, lambda: [pool.release(x) for x in held])  # type: ignore[arg-type]
    freeing.start()
    try:
        jobs = run(app, runner, "async_first_only", 8)
    finally:
        freeing.join()
    assert {(job.status, job.attempts) for job in jobs} == {(JobStatus.SUCCEEDED, 1)}
    assert calls[0] == 8, "the 8 jobs arriving together try the pool in one script"
    assert set(calls[1:]) == {1}, f"a try per waiting job, not one for the line: {calls}"
    _no_lease_left(app, (FIRST,))


def test_keys_given_back_in_one_turn_of_the_loop_go_back_in_one_round_trip(
    app: Harvest, runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 leases of one pool given back together (jobs ending in the same turn of the loop) go
    to Redis in one round trip, and no lease is left."""
    sizes: list[int] = []
    real = AsyncKeyPool.release_each

    async def spy(self: AsyncKeyPool, releases: Any) -> Any:
        sizes.append(len(releases))
        return await real(self, releases)

    monkeypatch.setattr(AsyncKeyPool, "release_each", spy)
    where = app.redis.get_connection_kwargs()

    async def scenario() -> list[Lease | Busy | None]:
        client = AsyncRedis(host=where["host"], port=where["port"], db=where["db"])
        try:
            gate = AsyncGate(runner.sync.gate, client)
            leases = await asyncio.gather(*(gate.try_lease(FIRST, f"job-{i}") for i in range(4)))
            await asyncio.gather(*(gate.release(x) for x in leases if isinstance(x, Lease)))
            return leases
        finally:
            await client.aclose()

    leases = asyncio.run(scenario())
    assert sum(isinstance(x, Lease) for x in leases) == 4
    assert sizes == [4], f"not one round trip for the 4 releases: {sizes}"
    assert {k.live_leases for k in KeyPool(app.redis, FIRST).snapshot()} == {0}


def test_more_lease_tries_at_once_than_one_script_takes_are_split_not_refused(
    app: Harvest, runner: Runner
) -> None:
    """1,001 tries for a pool in one turn of the loop (more than a script's 1,000 leases): each
    gets an answer, 4 leases (the pool's 4 slots) and Busy for the rest, not an error."""
    where = app.redis.get_connection_kwargs()

    async def scenario() -> list[Lease | Busy | None]:
        client = AsyncRedis(host=where["host"], port=where["port"], db=where["db"])
        try:
            gate = AsyncGate(runner.sync.gate, client)
            tries = [gate.try_lease(FIRST, f"job-{i}") for i in range(1001)]
            results = await asyncio.gather(*tries)
            for lease in results:
                if isinstance(lease, Lease):
                    await gate.release(lease)
            return results
        finally:
            await client.aclose()

    results = asyncio.run(scenario())
    assert sum(isinstance(x, Lease) for x in results) == 4
    assert sum(isinstance(x, Busy) for x in results) == 997


def test_a_job_that_took_its_key_ahead_gives_it_back_when_the_message_ends_early(
    app: Harvest, runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The statement that ends the first job and starts the second fails (Postgres went
    away): the message ends with the error, and the second job, which had leased its key
    while the first ended, gives the key back at once rather than when its lease expires."""
    db = runner.sync.db

    def failing(query: Any) -> Any:
        if query.sql == sql._FINISH_THEN_START:
            raise psycopg.OperationalError("the server closed the connection unexpectedly")
        return db(query)

    monkeypatch.setattr(runner.sync, "db", failing)
    app.enqueue_many("fallback_call", [{}] * 2)
    with pytest.raises(psycopg.OperationalError):
        runner.execute(body(claim_all(app.engine)))
    assert [k.live_leases for k in KeyPool(app.redis, FIRST).snapshot()] == [0, 0]


def test_with_every_pool_out_a_job_is_deferred_without_an_attempt(
    app: Harvest, runner: Runner, redis_client: redis.Redis
) -> None:
    disable(app)
    pool = KeyPool(redis_client, SECOND)
    (key,) = pool.snapshot()
    pool.cooldown(key.key_id, 60.0)
    ids = app.enqueue_many("fallback_call", [{}] * 2)
    assert runner.execute(body(claim_all(app.engine)))["deferred"] == 2
    with app.engine.connect() as conn:
        jobs = [store.get(conn, i) for i in ids]
    assert all(j is not None and j.status is JobStatus.PENDING and j.attempts == 0 for j in jobs)


def test_dispatch_counts_the_pools_together(app: Harvest) -> None:
    ids = app.enqueue_many("fallback_call", [{}] * 30)
    dispatcher.dispatch(app)
    published = app.broker.published  # type: ignore[attr-defined]
    # three keys of concurrency 2 over both pools, and three sent ahead (half)
    assert len(set(ids) & set(published)) == 9
    dispatcher.dispatch(app)  # none has started: nothing more for the pair
    assert len(set(ids) & set(app.broker.published)) == 9  # type: ignore[attr-defined]


def test_dispatch_counts_a_job_started_and_waiting_for_a_key_as_waiting(app: Harvest) -> None:
    disable(app)  # the second pool's one key of concurrency 2 serves, and one is sent ahead
    ids = app.enqueue_many("fallback_call", [{}] * 30)
    dispatcher.dispatch(app)
    assert len(set(ids) & set(app.broker.published)) == 3  # type: ignore[attr-defined]
    with app.engine.begin() as conn:  # all three start: two take the key's slots, one waits
        pairs = [(int(r.id), r.lease_token) for r in conn.exec_driver_sql(
            "SELECT id, lease_token FROM harvest_jobs WHERE status = 'dispatched'")]  # fmt: skip
        assert len(sql.run(conn, sql.start(pairs, ttl=60.0, worker="w"))) == 3
    pool = KeyPool(app.redis, SECOND)
    assert all(isinstance(pool.lease(f"w:{i}", 60.0), Lease) for i, _ in pairs[:2])
    dispatcher.dispatch(app)  # no key free, and the one sent ahead is at the gate already
    assert len(set(ids) & set(app.broker.published)) == 3  # type: ignore[attr-defined]


def test_dispatch_counts_only_the_pools_that_can_serve(app: Harvest) -> None:
    disable(app)
    ids = app.enqueue_many("fallback_call", [{}] * 30)
    dispatcher.dispatch(app)
    # the second pool's one key of concurrency 2, and one sent ahead
    assert len(set(ids) & set(app.broker.published)) == 3  # type: ignore[attr-defined]
