"""Process faults under load: SIGKILL (F1), SIGTERM (F2), a job outliving the broker's
visibility timeout (F3), and a worker paused past its lease (F7)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable

import pytest

from harvest.broker import make_celery
from tests.chaos.conftest import (
    World,
    record,
    wait_until,
)
from tests.chaos.kills import kill_under_load, record_kills

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

F1_JOBS = int(os.environ.get("CHAOS_F1_JOBS", "5000"))  # the count
F1_CAP = 300.0  # seconds of kills at most (the run takes about a minute on 2 cores)
F1_CONCURRENCY = 6  # the jobs sleep: 2 workers x 6 children drain them in about a minute


@pytest.mark.timeout(540)
def test_f1_sigkill_children_and_main_processes_under_load(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    world = make_world()
    roles = world.standard(execution=2, concurrency=F1_CONCURRENCY)
    ids = world.enqueue(F1_JOBS, low_ms=20, high_ms=200)
    run = kill_under_load(
        world,
        ids,
        list(roles.execution),
        lambda: world.cluster.worker("execution", concurrency=F1_CONCURRENCY),
        cap=F1_CAP,
    )
    record_kills(
        "F1",
        "SIGKILL children and main workers",
        request,
        world,
        ids,
        run,
        f"jobs sleep 20-200 ms; 2 workers x {F1_CONCURRENCY} children",
    )


@pytest.mark.timeout(200)
def test_f2_sigterm_mid_job_finishes_or_hands_back(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    world = make_world()
    roles = world.standard(execution=2, concurrency=2)
    ids = world.enqueue(24, seconds=1.0, hold=0.01)
    victim = roles.execution[0]
    kids = world.cluster.children(victim)
    wait_until(
        lambda: len(world.executions_of(kids, running_at=time.time())) >= 2,
        30,
        0.05,
        "jobs running in the worker about to be stopped",
    )
    at = time.time()
    victim.send_signal(signal.SIGTERM)  # warm shutdown of the main process, as Celery documents
    in_flight = {r.job_id for r in world.executions_of(kids, running_at=at)}
    try:
        code = victim.wait(40)
    except subprocess.TimeoutExpired:
        code = None
    stopped_in = time.time() - at
    world.cluster.worker("execution", concurrency=2)
    world.wait_done(ids, 120)
    figures = world.figures(ids)
    finished_by_victim = {
        r.job_id
        for r in world.sql(
            "SELECT job_id FROM chaos_effects WHERE job_id = ANY(:ids) AND pid = ANY(:pids)",
            ids=list(in_flight),
            pids=kids,
        )
    }
    record(
        "F2",
        "SIGTERM (warm shutdown) mid-job",
        request,
        jobs=len(ids),
        **figures.row(),
        worst_recovery=stopped_in,
        overlaps=world.overlaps(),
        notes=(
            f"{len(in_flight)} in flight at SIGTERM: {len(finished_by_victim)} finished by the "
            f"stopping worker, {len(in_flight - finished_by_victim)} handed back; exit code {code} "
            f"after {stopped_in:.1f} s (shown as recovery); messages it had reserved went back"
        ),
    )
    assert in_flight, "SIGTERM found no job in flight"
    assert code == 0, "the worker did not finish its warm shutdown"
    assert figures.lost == 0 and figures.statuses == {"succeeded": len(ids)}
    assert figures.duplicate_effects == 0 and figures.double_claims == 0
    assert world.overlaps() == 0


@pytest.mark.timeout(120)
def test_f3_redelivery_past_visibility_timeout_does_nothing(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    # A visibility timeout far below the job's run time: the broker hands the message out again
    # while the job still runs. kombu's Redis transport restores unacked messages older than
    # the timeout in a sweep its consumers run only every ~100 s (unacked_restore_interval 10 s
    # x throttle 10), so the test runs that same sweep once the timeout has passed.
    world = make_world(HARVEST_BROKER_VISIBILITY_TIMEOUT="2")
    world.standard(execution=2, concurrency=2)
    ids = world.enqueue(3, seconds=8.0, hold=0.01)
    wait_until(
        lambda: world.statuses(ids).get("running", 0) == 3, 30, 0.1, "the 3 long jobs to run"
    )
    time.sleep(3.0)  # past the visibility timeout
    celery = make_celery(world.settings)
    try:
        with celery.connection_for_write() as conn:
            channel = conn.default_channel
            assert channel.visibility_timeout == 2
            channel.qos.restore_visible(num=channel.unacked_restore_limit, interval=1)
    finally:
        celery.close()
    wait_until(
        lambda: world.counters().get("duplicate_deliveries_suppressed", 0) >= len(ids),
        20,
        0.1,
        "the redelivered copies to reach a worker",
    )
    world.wait_done(ids, 60)
    figures = world.figures(ids)
    suppressed = world.counters().get("duplicate_deliveries_suppressed", 0)
    record(
        "F3",
        "job outlives the visibility timeout",
        request,
        jobs=len(ids),
        **figures.row(),
        overlaps=world.overlaps(),
        notes=(
            f"visibility timeout 2 s, jobs 8 s: {suppressed} copies redelivered while running, "
            "each refused at hold (HARVEST_BROKER_VISIBILITY_TIMEOUT: no 60 s floor)"
        ),
    )
    assert suppressed >= len(ids), "the broker did not redeliver: nothing was tested"
    assert figures.executions == len(ids), "a redelivered copy ran the handler"
    assert figures.lost == 0 and figures.duplicate_effects == 0
    assert world.overlaps() == 0


@pytest.mark.timeout(150)
def test_f7_paused_worker_resumes_with_a_stale_lease(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    from tests.chaos.jobs import SOLO

    world = make_world()
    world.add_keys(n=1, concurrency=1, pool=SOLO)
    world.cluster.worker("schedule", concurrency=1)
    world.cluster.worker("execution", concurrency=1)
    world.cluster.worker("execution", concurrency=1)
    world.cluster.beat()
    world.cluster.wait_ready()
    (job,) = world.client.enqueue_many("chaos.solo", [{"url": world.url}])

    def attempt(n: int) -> tuple[int, float] | None:
        rows = world.sql(
            "SELECT pid, extract(epoch FROM started_at) FROM chaos_executions "
            "WHERE job_id = :job AND attempt = :n",
            job=job,
            n=n,
        )
        return (int(rows[0][0]), float(rows[0][1])) if rows else None

    pid, _ = wait_until(lambda: attempt(1), 30, 0.05, "attempt 1 to start")
    paused = next(p for p in world.cluster.procs if pid in world.cluster.children(p))
    os.killpg(paused.pid, signal.SIGSTOP)  # main and child: no heartbeat, no renewal
    paused_at = time.time()
    try:
        _, second_start = wait_until(lambda: attempt(2), 40, 0.05, "attempt 2 elsewhere")
        # Attempt 2 works 4 s, then holds the key at the API for 3 s: resume inside that call.
        time.sleep(max(0.0, second_start + 5.0 - time.time()))
    finally:
        os.killpg(paused.pid, signal.SIGCONT)
    resumed_at = time.time()
    world.wait_done([job], 40)
    # The resumed attempt 1 must not act: ctx.client() finds its key lease gone and refuses
    # to call (LeaseLost), or, had it called, the fence refuses its effect; either way the
    # fenced finish drops its outcome.
    wait_until(
        lambda: world.counters().get("lost_outcomes_dropped", 0) >= 1,
        20,
        0.1,
        "the resumed attempt 1's outcome to be refused",
    )
    figures = world.figures([job])
    outcome = world.scalar("SELECT result->>'attempt' FROM harvest_jobs WHERE id = :j", j=job)
    dropped = world.counters().get("lost_outcomes_dropped", 0)
    stale = str(
        world.scalar(
            "SELECT outcome FROM chaos_executions WHERE job_id = :job AND attempt = 1", job=job
        )
    )
    refused = stale in ("None", "stale") or stale.startswith("error LeaseLost")
    calls = sorted(world.calls(), key=lambda c: c.start)
    timeline = ", ".join(
        f"fence {c.fence} {c.start - resumed_at:+.2f}..{c.end - resumed_at:+.2f} s" for c in calls
    )
    record(
        "F7",
        "worker paused past its lease, resumed",
        request,
        jobs=1,
        **figures.row(),
        worst_recovery=second_start - paused_at,
        overlaps=world.overlaps(),
        notes=(
            f"paused {resumed_at - paused_at:.1f} s (lease 3 s); resumed attempt 1: "
            f"{stale.partition(':')[0]}; its finish refused: {dropped >= 1}; the result is attempt "
            f"{outcome}'s; calls on the pool's only key (max_concurrency 1), from the resume: "
            f"{timeline}"
        ),
    )
    assert figures.lost == 0 and figures.duplicate_effects == 0
    assert refused, f"the resumed attempt acted: {stale}"
    assert dropped >= 1 and outcome == "2", "the stale finish was not refused"
    assert world.overlaps() == 0, "the resumed worker used the key while attempt 2 held it"
