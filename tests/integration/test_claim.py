"""store.claim_due: exclusive across OS processes, in priority-then-age order, never early."""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import random
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from sqlalchemy import Connection, Engine, text

from harvest import dispatcher, store
from harvest.app import Harvest
from harvest.db import make_engine
from harvest.models import JobStatus
from harvest.settings import Settings
from tests.helpers import RecordingBroker

PRELOAD = ["sqlalchemy", "psycopg", "harvest.db", "harvest.store", __name__]


def insert_jobs(engine: Engine, rows: list[tuple[int, datetime]]) -> list[int]:
    """Insert pending noop jobs with the given (priority, run_at); returns their ids in order."""
    with engine.begin() as conn:
        return [
            int(
                conn.execute(
                    text(
                        "INSERT INTO harvest_jobs (name, priority, run_at) "
                        "VALUES ('noop', :priority, :run_at) RETURNING id"
                    ),
                    {"priority": priority, "run_at": run_at},
                ).scalar_one()
            )
            for priority, run_at in rows
        ]


def insert_due(engine: Engine, n: int) -> list[int]:
    with engine.begin() as conn:
        return list(
            conn.execute(
                text(
                    "INSERT INTO harvest_jobs (name, run_at) "
                    "SELECT 'noop', now() - interval '1 second' FROM generate_series(1, :n) "
                    "RETURNING id"
                ),
                {"n": n},
            ).scalars()
        )


def claim(engine: Engine, limit: int, ttl: float = 300) -> list[int]:
    with engine.begin() as conn:
        return [c.id for c in store.claim_due(conn, limit=limit, ttl=ttl)]


def plan_cache_mode(conn: Connection) -> Callable[[], str]:
    """What ``SHOW plan_cache_mode`` says on ``conn``'s driver connection, each time asked."""
    raw = conn.connection.driver_connection
    assert raw is not None
    return lambda: str(raw.execute("SHOW plan_cache_mode").fetchone()[0])


def claim_until_empty(engine: Engine, limit: int) -> list[int]:
    order: list[int] = []
    while batch := claim(engine, limit):
        order.extend(batch)
    return order


# --- exclusivity across processes -----------------------------------------------------------


def claimer(url: str, index: int, barrier: Any, results: Any) -> None:
    """One process, its own engine and connection: claim batches of 50 until none is due."""
    try:
        engine = make_engine(Settings(database_url=url), pool_size=1)
        claimed: list[tuple[int, str]] = []
        barrier.wait(60)
        while True:
            with engine.begin() as conn:
                batch = store.claim_due(conn, limit=50, ttl=300)
            if not batch:
                break
            claimed.extend((c.id, str(c.token)) for c in batch)
        engine.dispose()
        results.put((index, claimed, None))
    except BaseException as exc:
        results.put((index, None, f"{type(exc).__name__}: {exc}"))


def test_four_processes_claim_every_row_exactly_once(clean_db: Engine, migrated: Settings) -> None:
    ids = insert_due(clean_db, 5000)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    barrier = ctx.Barrier(4)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=claimer, args=(migrated.database_url, i, barrier, results))
        for i in range(4)
    ]
    for p in procs:
        p.start()
    reports: dict[int, list[tuple[int, str]]] = {}
    errors: list[str] = []
    try:
        for _ in procs:
            index, claimed, error = results.get(timeout=60)
            if error:
                errors.append(error)
            else:
                reports[index] = claimed
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    assert not errors, errors
    assert len(reports) == 4

    per_process = [{job_id for job_id, _ in claimed} for claimed in reports.values()]
    claimed_ids = [job_id for claimed in reports.values() for job_id, _ in claimed]
    assert len(claimed_ids) == len(ids), "some row was claimed twice (or some never)"
    assert set(claimed_ids) == set(ids)
    for i, mine in enumerate(per_process):
        for theirs in per_process[i + 1 :]:
            assert not mine & theirs
    assert sum(1 for mine in per_process if mine) >= 2, "no two processes claimed concurrently"

    tokens = {job_id: token for claimed in reports.values() for job_id, token in claimed}
    with clean_db.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT id, status, lease_token::text AS token, dispatched_at, "
                "lease_expires_at > now() AS leased FROM harvest_jobs"
            )
        ).all()
    assert {r.status for r in rows} == {"dispatched"}
    assert all(r.dispatched_at is not None and r.leased for r in rows)
    assert {r.id: r.token for r in rows} == tokens
    assert len(set(tokens.values())) == len(ids), "two claims share a lease token"


# --- order ----------------------------------------------------------------------------------


def test_claim_order_is_priority_then_run_at_then_id(clean_db: Engine) -> None:
    now = datetime.now(UTC)
    ago = lambda s: now - timedelta(seconds=s)  # noqa: E731
    a, b, c, d, e, f, g = insert_jobs(
        clean_db,
        [
            (0, ago(100)),
            (5, ago(10)),
            (5, ago(50)),
            (-3, ago(1000)),
            (10, ago(1)),
            (0, ago(200)),
            (5, ago(50)),
        ],
    )
    assert claim(clean_db, 3) == [e, c, g]  # the LIMIT takes the top three, in order
    assert claim(clean_db, 100) == [b, f, a, d]
    assert claim(clean_db, 100) == []


def test_claiming_in_small_batches_follows_the_global_order(clean_db: Engine) -> None:
    rng = random.Random(20240601)
    now = datetime.now(UTC)
    rows = [
        (rng.choice([-1000, -5, 0, 0, 0, 1, 7, 1000]), now - timedelta(seconds=rng.randint(1, 50)))
        for _ in range(300)
    ]
    ids = insert_jobs(clean_db, rows)
    expected = [
        job_id
        for job_id, _ in sorted(
            zip(ids, rows, strict=True), key=lambda x: (-x[1][0], x[1][1], x[0])
        )
    ]
    assert claim_until_empty(clean_db, 7) == expected


def test_rows_not_yet_due_are_never_claimed(clean_db: Engine) -> None:
    now = datetime.now(UTC)
    due = insert_jobs(clean_db, [(0, now - timedelta(seconds=1))] * 5)
    future = insert_jobs(
        clean_db,
        [
            (1000, now + timedelta(hours=1)),
            (0, now + timedelta(minutes=5)),
            (0, now + timedelta(seconds=30)),
        ],
    )
    assert sorted(claim_until_empty(clean_db, 2)) == due
    with clean_db.connect() as conn:
        rows = conn.execute(
            text("SELECT status, lease_token FROM harvest_jobs WHERE id = ANY(:ids)"),
            {"ids": future},
        ).all()
    assert rows and all(r.status == "pending" and r.lease_token is None for r in rows)


def test_zero_limit_claims_nothing(clean_db: Engine) -> None:
    insert_due(clean_db, 3)
    assert claim(clean_db, 0) == []
    with clean_db.connect() as conn:
        assert store.counts_by_status(conn) == {"pending": 3}


def test_inflight_counts_dispatched_and_running(clean_db: Engine) -> None:
    insert_due(clean_db, 6)
    with clean_db.begin() as conn:
        assert store.inflight(conn) == 0
        claimed = store.claim_due(conn, limit=4, ttl=300)
    with clean_db.begin() as conn:
        assert store.inflight(conn) == 4
        started = [store.start(conn, c.id, c.token, ttl=300) for c in claimed[:2]]
        assert all(started)
    with clean_db.begin() as conn:
        assert store.inflight(conn) == 4
        assert store.counts_by_status(conn) == {"pending": 2, "dispatched": 2, "running": 2}
        assert store.finish(conn, claimed[0].id, claimed[0].token, status=JobStatus.SUCCEEDED)
    with clean_db.begin() as conn:
        assert store.inflight(conn) == 3
        conn.execute(
            text(
                "UPDATE harvest_jobs SET lease_expires_at = now() - interval '1 s' WHERE id = :id"
            ),
            {"id": claimed[3].id},
        )
    with clean_db.begin() as conn:
        assert store.rescue_expired(conn, limit=10).requeued == [claimed[3].id]
    with clean_db.begin() as conn:
        assert store.inflight(conn) == 2


def test_claim_takes_a_lease_of_the_given_length(clean_db: Engine) -> None:
    insert_due(clean_db, 1)
    claim(clean_db, 1, ttl=90)
    with clean_db.connect() as conn:
        seconds = conn.execute(
            text("SELECT extract(epoch FROM lease_expires_at - dispatched_at) FROM harvest_jobs")
        ).scalar_one()
    assert float(seconds) == pytest.approx(90, abs=0.01)


def test_claim_skips_rows_locked_by_another_claimer(clean_db: Engine) -> None:
    ids = insert_due(clean_db, 10)
    with clean_db.connect() as first:
        tx = first.begin()
        held = [c.id for c in store.claim_due(first, limit=4, ttl=300)]
        started = time.monotonic()
        other = claim(clean_db, 100)  # must not wait for the open transaction
        assert time.monotonic() - started < 2
        tx.commit()
    assert sorted(held + other) == ids
    assert not set(held) & set(other)


def test_the_claims_generic_plan_setting_never_outlives_its_statement(clean_db: Engine) -> None:
    """The claim's generic plan is set for its own statement only: after a claim, and after
    a statement that failed in its place, the connection plans as the session says (the
    dispatcher's other statements on that connection keep custom plans)."""
    from harvest.execution import sql as statements

    insert_due(clean_db, 3)
    with clean_db.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        mode = plan_cache_mode(conn)
        assert mode() == "auto"
        assert len(store.claim_due(conn, limit=2, ttl=60)) == 2
        assert mode() == "auto"
        failing = statements.Query("SELECT 1 / %(zero)s AS x", {"zero": 0}, list)
        with pytest.raises(Exception, match="division by zero"):
            statements.run_generic(conn, failing)
        assert mode() == "auto"
        assert len(store.claim_due(conn, limit=2, ttl=60)) == 1  # the connection still works


@pytest.mark.parametrize("backlog", [3_000, 19_358])
def test_the_claim_never_reads_the_whole_jobs_table(clean_db: Engine, backlog: int) -> None:
    """The plans the dispatcher's claims run with (generic: one for every batch) read the rows
    they take by an index, each of the three claims, whatever the backlog's size. At these two
    sizes the plan once hash-joined the chosen rows to a sequential scan of the whole table:
    a claim of one row took 2.6 ms instead of 1.0."""
    insert_due(clean_db, backlog)
    with clean_db.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(text("VACUUM ANALYZE harvest_jobs"))
        claimed = 0
        # The one-tenant claim (no tenants, no aging look, no budgets), the tenants' claim
        # (looking for starving jobs) and the one with budgets.
        for budgets, starve in ((None, None), (None, 300.0), ({"a-pool": 5}, None)):
            for limit in (1, 10, 100):
                claimed += len(
                    store.claim_due(
                        conn, limit=limit, ttl=60, budgets=budgets, starvation_after=starve
                    )
                )
        assert claimed == 3 * (1 + 10 + 100)  # the jobs have no key pool: no budget holds them
        # The claims' own prepared statements, explained as they run (parameters do not
        # shape a generic plan: NULLs stand in for them).
        raw = conn.connection.driver_connection
        assert raw is not None
        prepared = raw.execute(
            "SELECT name, parameter_types FROM pg_prepared_statements "
            "WHERE statement LIKE '%%FOR UPDATE SKIP LOCKED%%'"
        ).fetchall()
        assert len(prepared) == 3
        plans = []
        with raw.transaction():
            raw.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            for name, types in prepared:
                nulls = ", ".join(f"NULL::{t}" for t in types)
                rows = raw.execute(f'EXPLAIN EXECUTE "{name}" ({nulls})').fetchall()
                plans.append("\n".join(r[0] for r in rows))
    for plan in plans:
        assert "Seq Scan on harvest_jobs" not in plan, plan


def test_a_claim_round_plans_generically_until_it_ends_however_it_ends(clean_db: Engine) -> None:
    """In a claim_round block (a dispatch call's rounds) the connection plans generically
    from its first statement to its last, the claims work as outside it, and the setting is
    reset when the block ends, by an error too: the pooled connection goes back as it came."""
    insert_due(clean_db, 5)
    with clean_db.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        mode = plan_cache_mode(conn)
        with store.claim_round(conn):
            assert mode() == "force_generic_plan"
            assert len(store.claim_due(conn, limit=2, ttl=60)) == 2
            assert mode() == "force_generic_plan"  # the claim left the block's setting alone
            with store.claim_round(conn):  # a block inside another changes nothing
                assert len(store.claim_due(conn, limit=1, ttl=60)) == 1
            assert mode() == "force_generic_plan"
        assert mode() == "auto"
        with pytest.raises(RuntimeError, match="in the block"), store.claim_round(conn):
            assert len(store.claim_due(conn, limit=1, ttl=60)) == 1
            raise RuntimeError("failed in the block")
        assert mode() == "auto"
        assert len(store.claim_due(conn, limit=5, ttl=60)) == 1  # the connection still works


@pytest.fixture
def no_autovacuum(clean_db: Engine) -> Iterator[Engine]:
    """harvest_jobs without autovacuum for the test: its statistics change only when the test
    (or harvest) analyzes the table."""
    with clean_db.begin() as conn:
        conn.execute(text("ALTER TABLE harvest_jobs SET (autovacuum_enabled = false)"))
    yield clean_db
    with clean_db.begin() as conn:
        conn.execute(text("ALTER TABLE harvest_jobs RESET (autovacuum_enabled)"))


def analyze(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        conn.exec_driver_sql("ANALYZE harvest_jobs")


def quiet_spell(engine: Engine) -> None:
    """The table as after a quiet spell: 3,000 jobs, every one finished, and analyzed so."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO harvest_jobs (name, status) "
                "SELECT 'noop', 'succeeded' FROM generate_series(1, 3000)"
            )
        )
    analyze(engine)


def planned(engine: Engine) -> int:
    with engine.connect() as conn:
        return store.planned_pending(conn)


def dispatch_once(settings: Settings, redis_client: redis.Redis) -> int:
    app = Harvest(settings, broker=RecordingBroker(settings), redis_client=redis_client)
    try:
        return dispatcher.dispatch(app).claimed
    finally:
        app.close()


def test_a_burst_after_a_quiet_spell_gets_the_jobs_table_analyzed_by_the_dispatcher(
    migrated: Settings,
    no_autovacuum: Engine,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Statistics made while every job had finished say a claim finds about one row: the
    planner then sorts the whole backlog at every claim until autovacuum comes by (up to a
    minute). The dispatcher sees it after its first claim and analyzes the table there and
    then, once."""
    quiet_spell(no_autovacuum)
    insert_due(no_autovacuum, 3000)
    assert planned(no_autovacuum) < 10  # what the planner believes: nothing pending
    settings = migrated.model_copy(update={"claim_batch_size": 50, "inflight_window": 100})
    with caplog.at_level(logging.INFO, logger="harvest.dispatcher"):
        assert dispatch_once(settings, redis_client) == 100
    assert planned(no_autovacuum) > 2000  # 2,900 left
    stale = [r.getMessage() for r in caplog.records if "were stale" in r.getMessage()]
    assert len(stale) == 1
    assert "the planner expected 1 pending jobs, there are 1000 or more" in stale[0]
    assert int(stale[0].rsplit("expects ", 1)[1].split()[0]) > 2000


def finish_all(engine: Engine) -> None:
    """Every job finished (the burst drained), and the table analyzed so, as autovacuum does
    after a drain: the planner expects no pending job again."""
    with engine.begin() as conn:
        conn.execute(text("UPDATE harvest_jobs SET status = 'succeeded', finished_at = now()"))
    analyze(engine)


def burst_claimed(engine: Engine, watch: store.StatsWatch) -> store.Analyzed | None:
    """3,000 jobs arrive and one claim of 50 takes some; what the watch does after it."""
    insert_due(engine, 3000)
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        return watch.claimed(conn, len(store.claim_due(conn, limit=50, ttl=60)))


def test_a_burst_seconds_after_another_is_analyzed_at_its_first_claim(
    no_autovacuum: Engine,
) -> None:
    """Bursts that come seconds apart, the table analyzed empty between them: each one's
    statistics are made afresh at its first claim. (Waiting 10 s after every ANALYZE left the
    second burst's claims reading and sorting its whole backlog, 100-400 ms each, for the rest
    of those 10 s.)"""
    watch = store.StatsWatch()
    quiet_spell(no_autovacuum)
    first = burst_claimed(no_autovacuum, watch)
    assert first is not None and first.planned < 10 and first.after > 2000
    finish_all(no_autovacuum)
    assert planned(no_autovacuum) < 10
    with no_autovacuum.connect() as conn:  # the dispatcher's claim between them finds nothing
        assert watch.claimed(conn, len(store.claim_due(conn, limit=50, ttl=60))) is None
    second = burst_claimed(no_autovacuum, watch)  # within a second of the first
    assert second is not None and second.planned < 10 and second.after > 2000
    assert planned(no_autovacuum) > 2000


def test_an_analyze_that_postgres_skipped_is_tried_again_only_after_analyze_every(
    no_autovacuum: Engine,
) -> None:
    """While another ANALYZE (or VACUUM) holds the table, ``ANALYZE (SKIP_LOCKED)`` does
    nothing: the watch does not ask again at every claim, but ``analyze_every`` later."""
    watch = store.StatsWatch(check_every=0.0, analyze_every=1.0)
    quiet_spell(no_autovacuum)
    insert_due(no_autovacuum, 3000)
    with no_autovacuum.connect() as holder, no_autovacuum.connect() as conn:
        holder.execute(text("LOCK TABLE harvest_jobs IN SHARE UPDATE EXCLUSIVE MODE"))
        conn.execution_options(isolation_level="AUTOCOMMIT")
        skipped = watch.claimed(conn, len(store.claim_due(conn, limit=50, ttl=60)))
        assert skipped is not None and skipped.after == skipped.planned < 10
        holder.rollback()  # the other ANALYZE is done
        assert watch.claimed(conn, len(store.claim_due(conn, limit=50, ttl=60))) is None
        assert planned(no_autovacuum) < 10
        time.sleep(1.0)
        again = watch.claimed(conn, len(store.claim_due(conn, limit=50, ttl=60)))
        assert again is not None and again.after > 2000


def test_the_dispatcher_leaves_statistics_that_describe_the_backlog_alone(
    migrated: Settings,
    no_autovacuum: Engine,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    insert_due(no_autovacuum, 3000)
    analyze(no_autovacuum)
    settings = migrated.model_copy(update={"claim_batch_size": 50, "inflight_window": 100})
    with caplog.at_level(logging.INFO, logger="harvest.dispatcher"):
        assert dispatch_once(settings, redis_client) == 100
    assert not [r for r in caplog.records if "statistics" in r.getMessage()]


def test_jobs_claimed_as_fast_as_they_come_leave_the_statistics_alone(
    migrated: Settings,
    no_autovacuum: Engine,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The statistics say nothing is pending and the claim takes every job there is: they are
    right again, and no ANALYZE is made (one made then would see none pending either)."""
    quiet_spell(no_autovacuum)
    insert_due(no_autovacuum, 30)
    settings = migrated.model_copy(update={"claim_batch_size": 50, "inflight_window": 100})
    with caplog.at_level(logging.INFO, logger="harvest.dispatcher"):
        assert dispatch_once(settings, redis_client) == 30
    assert not [r for r in caplog.records if "statistics" in r.getMessage()]


def test_budgets_that_cannot_bind_claim_what_the_claim_without_them_does(
    clean_db: Engine,
) -> None:
    """A claim of ``limit`` rows with every pool's budget at least ``limit`` (keys to spare)
    takes the rows the claim without budgets takes, in its order; one budget below ``limit``
    still holds its pool to it."""
    seed = random.randrange(2**32)  # named when the test fails, to run that backlog again
    rng = random.Random(seed)
    rows = [(rng.choice((-1, 0, 5)), datetime.now(UTC) - timedelta(seconds=i)) for i in range(90)]
    ids = insert_jobs(clean_db, rows)
    with clean_db.begin() as conn:  # a third of the jobs in pool a, a third in b, the rest none
        conn.execute(
            text(
                "UPDATE harvest_jobs SET pool = CASE WHEN id % 3 = 0 THEN 'a' WHEN id % 3 = 1"
                " THEN 'b' END WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        )

    def claims(budgets: dict[str, int] | None, limit: int = 12) -> list[tuple[int, str | None]]:
        with clean_db.begin() as conn:
            got = [c.id for c in store.claim_due(conn, limit=limit, ttl=60, budgets=budgets)]
            pools = dict(
                conn.execute(
                    text("SELECT id, pool FROM harvest_jobs WHERE id = ANY(:ids)"), {"ids": got}
                ).all()
            )
            conn.rollback()  # every claim sees the same backlog
        return [(i, pools[i]) for i in got]

    plain = claims(None)
    assert len(plain) == 12
    assert claims({"a": 12, "b": 400}) == plain
    # Held to 2 of pool a: the claim's order with a's rows past its second left out (the head
    # of 12 may hold fewer than 2 of them: a budget is a bound, not a quota)
    expected: list[tuple[int, str | None]] = []
    for job in claims(None, limit=90):
        if job[1] != "a" or sum(1 for _, pool in expected if pool == "a") < 2:
            expected.append(job)
    assert claims({"a": 2, "b": 400}) == expected[:12], f"seed {seed}"
