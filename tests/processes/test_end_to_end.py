"""The core promise, on real processes: enqueue -> schedule worker -> execution worker -> done.

Each test runs twice: straight to Postgres, and through a real PgBouncer in transaction mode
(``HARVEST_DATABASE_POOLER=transaction``) whose pool of server connections is smaller than the
number of harvest processes; that run also fails if any log says the pooler broke something
(the ``routed`` fixture)."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Engine, text

from harvest.app import Harvest
from harvest.models import JobStatus
from tests.helpers import statuses
from tests.pgbouncer import POOL_SIZE, PgBouncer
from tests.processes.conftest import Cluster, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.parametrize("routed", ["direct", "pgbouncer"], indirect=True),
]


def test_thousand_jobs_each_finish_exactly_once(
    cluster: Cluster, client_app: Harvest, effects: Engine, request: pytest.FixtureRequest
) -> None:
    bouncer: PgBouncer | None = None
    if cluster.settings.pooled:
        # 21 harvest processes (2 schedule, 4 x 3 execution and their 5 parents, beat, this
        # one) through PgBouncer's 10 server connections.
        bouncer = request.getfixturevalue("pgbouncer")
        cluster.worker("schedule", concurrency=2)
        for _ in range(4):
            cluster.worker("execution", concurrency=3)
        cluster.beat()
    else:
        cluster.up(execution=1)
    # Sync handlers, and async ones on each execution process's event loop (its own pool).
    ids = client_app.enqueue_many("effect", [{} for _ in range(700)])
    ids += client_app.enqueue_many("async_effect", [{} for _ in range(300)])
    assert len(set(ids)) == 1000
    clients = [0]

    def done() -> bool:
        if bouncer is not None:
            clients[0] = max(clients[0], bouncer.clients() - 1)  # not the console's own
        return statuses(effects, ids).get("succeeded") == 1000

    try:
        wait_until(done, 180, 0.5, "1000 succeeded")
    except AssertionError:
        print(statuses(effects, ids), cluster.logs())
        raise
    with effects.connect() as conn:
        per_job = conn.execute(
            text("SELECT job_id, count(*) FROM test_effects GROUP BY job_id")
        ).all()
        attempts = conn.execute(
            text("SELECT max(attempts), min(attempts) FROM harvest_jobs WHERE id = ANY(:ids)"),
            {"ids": ids},
        ).one()
    # Every job ran, exactly once (no crash here, so no re-execution either).
    assert sorted(j for j, _ in per_job) == sorted(ids)
    assert {n for _, n in per_job} == {1}
    assert tuple(attempts) == (1, 1)
    if bouncer is not None:  # many more clients than server connections, all served
        assert clients[0] > 2 * POOL_SIZE, clients[0]


def test_failing_job_retries_with_growing_delays_then_fails(
    cluster: Cluster, client_app: Harvest, effects: Engine
) -> None:
    cluster.up()
    ref = client_app.enqueue("always_fails", {"message": "upstream said no"})
    starts: list[datetime] = []
    seen_attempts: set[int] = set()

    def observe() -> bool:
        job = client_app.get(ref.id)
        if job.started_at and job.attempts not in seen_attempts:
            seen_attempts.add(job.attempts)
            starts.append(job.started_at)
        return job.status is JobStatus.FAILED

    wait_until(observe, 60, 0.05, "the failing job to end failed")
    job = client_app.get(ref.id)
    assert job.attempts == 3
    assert job.last_error == "RuntimeError: upstream said no (attempt 3)"
    assert job.last_traceback and "always_fails" in job.last_traceback
    assert len(starts) == 3, starts
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(starts)]
    # FAST_RETRY: 0.3 s then 0.6 s nominal (+-10 %): each wait is longer than the one before.
    assert gaps[0] >= 0.27
    assert gaps[1] > gaps[0]


def test_delayed_job_does_not_start_early(cluster: Cluster, client_app: Harvest) -> None:
    cluster.up()
    before = datetime.now(UTC)
    ref = client_app.enqueue("echo", {"value": 1}, delay=timedelta(seconds=4))
    job = client_app.wait(ref.id, timeout=30)
    assert job.status is JobStatus.SUCCEEDED
    assert job.started_at is not None
    assert job.started_at >= job.run_at
    assert (job.started_at - before).total_seconds() >= 4


def test_higher_priority_due_jobs_are_dispatched_first(
    cluster: Cluster, client_app: Harvest, engine: Engine
) -> None:
    # Everything is due before any worker runs: the claim order alone decides.
    low = client_app.enqueue_many("echo", [{"value": i} for i in range(300)], priority=0)
    high = client_app.enqueue_many("echo", [{"value": i} for i in range(30)], priority=10)
    cluster.up()
    wait_until(lambda: statuses(engine, low + high).get("succeeded") == 330, 120, 0.5, "all done")
    with engine.connect() as conn:
        last_high = conn.execute(
            text("SELECT max(dispatched_at) FROM harvest_jobs WHERE id = ANY(:ids)"), {"ids": high}
        ).scalar_one()
        low_before = conn.execute(
            text("SELECT count(*) FROM harvest_jobs WHERE id = ANY(:ids) AND dispatched_at < :t"),
            {"ids": low, "t": last_high},
        ).scalar_one()
    # The dispatcher claims in batches ordered by priority: no low job goes out before the last
    # high one (a low job claimed in the same batch shares its timestamp, not before it).
    assert low_before == 0


def test_sigkill_mid_job_is_rescued_and_succeeds(
    cluster: Cluster, client_app: Harvest, effects: Engine
) -> None:
    cluster.worker("schedule", concurrency=1)
    cluster.beat()
    victim = cluster.worker("execution", concurrency=1)
    ref = client_app.enqueue("effect", {"seconds": 4.0})
    wait_until(lambda: client_app.get(ref.id).status is JobStatus.RUNNING, 30, 0.1, "job running")
    killed_at = time.monotonic()
    cluster.kill(victim)  # SIGKILL to the whole worker: parent and its child
    victim.wait(10)
    cluster.worker("execution", concurrency=1)
    job = client_app.wait(ref.id, timeout=60)
    recovered = time.monotonic() - killed_at
    assert job.status is JobStatus.SUCCEEDED
    assert job.attempts == 2  # the killed attempt counted, the second succeeded
    # lease TTL 3 s + rescue every 1 s + the 4 s job itself, with slack for process start.
    assert recovered < 30


def test_every_second_schedule_fires_exactly_once_per_fire_time(
    cluster: Cluster, client_app: Harvest, engine: Engine
) -> None:
    client_app.schedule(
        "every-second", "tick", every=1, payload={"schedule": "every-second"},
        misfire="catch_up", catch_up=30,
    )  # fmt: skip
    cluster.worker("schedule", concurrency=2)  # two schedule processes race for each tick
    cluster.worker("execution", concurrency=2)
    cluster.beat()

    def ticks_run() -> int:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT count(*) FROM harvest_jobs "
                        "WHERE name = 'tick' AND status = 'succeeded'"
                    )
                ).scalar_one()
            )

    wait_until(lambda: ticks_run() >= 8, 90, 0.5, "8 ticks to run")
    stopped = client_app.pause_schedule("every-second")
    with engine.connect() as conn:
        runs = conn.execute(
            text(
                "SELECT run_at, count(*) AS n FROM harvest_jobs WHERE name = 'tick' "
                "GROUP BY run_at ORDER BY run_at"
            )
        ).all()
    assert {r.n for r in runs} == {1}, "a fire time got more than one job"
    times = [r.run_at for r in runs]
    assert {(b - a).total_seconds() for a, b in itertools.pairwise(times)} == {1.0}, times
    assert stopped.last_fired_at == times[-1]


def test_ended_jobs_move_to_the_history_while_workers_run_and_read_back(
    cluster: Cluster, client_app: Harvest, effects: Engine
) -> None:
    """Maintenance on beat moves each ended job into the day partitions (made on the way, and
    through PgBouncer in its run); the API and `harvest jobs show` read it back from there,
    attempts included, and a dead job retried from there runs again."""
    cluster.env.update({"HARVEST_HISTORY_AFTER": "0", "HARVEST_MAINTENANCE_INTERVAL": "1"})
    cluster.up()
    ids = client_app.enqueue_many("echo", [{"value": i} for i in range(200)])
    dead = client_app.enqueue("always_fails", {"message": "nope"}).id

    def in_history(attempts: int) -> bool:
        with effects.connect() as conn:
            moved = conn.execute(
                text(
                    "SELECT count(*) FROM harvest_job_history "
                    "WHERE id = ANY(:ids) OR (id = :dead AND attempts = :n)"
                ),
                {"ids": ids, "dead": dead, "n": attempts},
            ).scalar_one()
        return bool(moved == len(ids) + 1)

    wait_until(lambda: in_history(3), 120, 0.5, "every job in the history")
    with effects.connect() as conn:
        left = conn.execute(
            text("SELECT count(*) FROM harvest_jobs WHERE id = ANY(:ids) OR id = :dead"),
            {"ids": ids, "dead": dead},
        ).scalar_one()
    assert left == 0
    assert client_app.get(ids[7]).result == {"value": 7, "job_id": ids[7], "attempt": 1}
    shown = subprocess.run(
        [sys.executable, "-m", "harvest.cli", "jobs", "show", str(dead)],
        env={**cluster.env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "failed" in shown and "nope (attempt 3)" in shown
    assert shown.count("retry") == 2  # the two attempts before the last, from attempt_log

    client_app.retry(dead)  # back from the history, one more attempt allowed
    wait_until(lambda: in_history(4), 120, 0.5, "the retried job dead again, in the history")
    assert client_app.get(dead).last_error is not None
