"""Faults of the services (the session's PRIVATE Redis and Postgres only): Redis restarted (F4;
one execution worker runs with Celery's gossip, mingle and heartbeat, as the README's do),
every harvest backend terminated again and again (F5), Postgres stopped for 10 s (F6), a session
idle in transaction (F9), and the connection budget at full concurrency (F10)."""

from __future__ import annotations

import os
import random
import re
import statistics
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from harvest import store
from harvest.coordination.key_pool import KeyPool
from harvest.db import make_engine
from tests.chaos.conftest import World, record, wait_until
from tests.chaos.jobs import POOL

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

F5_SECONDS = float(os.environ.get("CHAOS_F5_SECONDS", "60"))


def _first_execution_after(world: World, at: float) -> float | None:
    value = world.scalar(
        "SELECT extract(epoch FROM min(started_at)) FROM chaos_executions "
        "WHERE started_at > to_timestamp(:t)",
        t=at,
    )
    return float(value) if value is not None else None


def _alive(procs: list[subprocess.Popen[bytes]]) -> bool:
    return all(p.poll() is None for p in procs)


@pytest.mark.timeout(200)
def test_f4_redis_restart_mid_run(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    world = make_world()
    roles = world.standard(execution=1, concurrency=2)
    readme = world.cluster.worker("execution", concurrency=2, celery_defaults=True)
    world.cluster.wait_worker(readme)
    roles.execution.append(readme)
    ids = world.enqueue(200)
    wait_until(lambda: world.succeeded_count(ids) >= 40, 60, 0.2, "the run to get going")
    world.services.redis_stop()  # no persistence: queues, leases and the pool are gone
    time.sleep(2.0)
    world.services.redis_start()
    up_at = time.time()
    first = wait_until(
        lambda: _first_execution_after(world, up_at), 30, 0.2, "workers to consume again"
    )
    world.wait_done(ids, 120)
    figures = world.figures(ids)
    logs = world.cluster.logs_all()
    rebuilt = "was rebuilt from Postgres" in logs
    loaded = KeyPool(world.client.redis, POOL).is_loaded()
    calls_after = sum(c.start > up_at for c in world.calls())
    record(
        "F4",
        "Redis restarted mid-run",
        request,
        jobs=len(ids),
        **figures.row(),
        worst_recovery=first - up_at,
        overlaps=world.overlaps(),
        notes=(
            f"down 2 s, no persistence; consuming again {first - up_at:.1f} s after it came "
            f"back; key pool rebuilt from Postgres: {rebuilt or loaded} ({calls_after} keyed "
            f"calls after); workers kept running: {_alive([roles.schedule, *roles.execution])}; "
            f"{figures.summary()}"
        ),
    )
    assert first - up_at <= 30
    assert loaded and calls_after > 0
    assert _alive([roles.schedule, *roles.execution, roles.beat])
    assert figures.lost == 0 and figures.statuses == {"succeeded": len(ids)}
    assert figures.duplicate_effects == 0 and figures.double_claims == 0
    assert world.overlaps() == 0
    # The worker run as the README's commands run it (gossip, mingle, heartbeat) reconnected
    # without a step's error and traceback (Celery 5.7's gossip failed at each reconnect).
    readme_log = world.cluster.log(readme)
    assert "Connection to broker lost" in readme_log
    assert "Error on " not in readme_log and "Traceback" not in readme_log, readme_log[-4000:]


def _terminate_harvest_backends(world: World) -> int:
    with world.services.admin() as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'harvest' AND pid <> pg_backend_pid()"
        ).fetchall()
    return len(rows)


def _enqueue_retrying(world: World, n: int) -> list[int]:
    """Enqueue through harvest (its connections are being terminated): retry a failed batch
    (one transaction: a failure stores nothing)."""
    for _ in range(20):
        try:
            return world.enqueue(n, low_ms=20, high_ms=100)
        except Exception:
            time.sleep(0.2)
    raise AssertionError("could not enqueue for 20 tries")


@pytest.mark.timeout(240)
def test_f5_backends_terminated_repeatedly(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    world = make_world()
    roles = world.standard(execution=2, concurrency=2)
    watched = [roles.schedule, *roles.execution, roles.beat]
    rng = random.Random(5)
    ids = _enqueue_retrying(world, 40)
    terminated = 0
    rounds: list[float] = []  # epoch seconds of each termination round
    started = time.monotonic()
    while time.monotonic() - started < F5_SECONDS:
        time.sleep(rng.uniform(1.5, 3.0))
        terminated += _terminate_harvest_backends(world)
        rounds.append(time.time())
        ids += _enqueue_retrying(world, 40)  # keep a backlog: progress is always possible
    assert _alive(watched), "a worker or beat died under terminations"
    world.wait_done(ids, 90)
    figures = world.figures(ids)
    logs = world.cluster.logs_all()
    lost_children = len(re.findall(r"WorkerLostError", logs))
    stuck = world.scalar(
        "SELECT count(*) FROM harvest_jobs WHERE status IN ('dispatched', 'running')"
    )
    gaps = [_next_success(world, ids, at, limit=0.0) for at in rounds]
    record(
        "F5",
        "pg_terminate_backend on every harvest connection",
        request,
        jobs=len(ids),
        **figures.row(),
        worst_recovery=max(gaps, default=None),
        overlaps=world.overlaps(),
        notes=(
            f"{terminated} backends terminated in {len(rounds)} rounds every 1.5-3 s for "
            f"{F5_SECONDS:.0f} s; recovery = a round to "
            f"the next success; worker children lost {lost_children}, every process up, "
            f"{stuck} jobs stuck; {figures.summary()}"
        ),
    )
    assert len(rounds) >= 8 and terminated >= len(rounds)
    assert _alive(watched), "a crash loop: a worker or beat died"
    assert lost_children == 0, "worker children died (crash loop)"
    assert stuck == 0
    assert max(gaps) < 15, "progress stalled after a termination round"
    assert figures.lost == 0 and figures.statuses == {"succeeded": len(ids)}
    assert figures.duplicate_effects == 0 and figures.double_claims == 0
    assert world.overlaps() == 0


def _next_success(world: World, ids: list[int], at: float, limit: float = 20.0) -> float:
    """Seconds from ``at`` (epoch) to the next job of ``ids`` to succeed (inf: none)."""
    deadline = time.monotonic() + limit
    while True:
        value = world.scalar(
            "SELECT extract(epoch FROM min(finished_at)) FROM harvest_jobs_all "
            "WHERE id = ANY(:ids) AND status = 'succeeded' AND finished_at > to_timestamp(:t)",
            ids=ids,
            t=at,
        )
        if value is not None:
            return float(value) - at
        if time.monotonic() >= deadline:
            return float("inf")
        time.sleep(0.1)


def _rate(world: World, ids: list[int], start: float, end: float) -> float:
    n = world.scalar(
        "SELECT count(*) FROM harvest_jobs_all WHERE id = ANY(:ids) AND status = 'succeeded' "
        "AND finished_at >= to_timestamp(:a) AND finished_at < to_timestamp(:b)",
        ids=ids,
        a=start,
        b=end,
    )
    return int(n) / (end - start)


@pytest.mark.timeout(200)
def test_f6_postgres_stopped_for_ten_seconds(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    world = make_world()
    roles = world.standard(execution=2, concurrency=2)
    ids = world.enqueue(450, low_ms=20, high_ms=60)
    wait_until(lambda: world.succeeded_count(ids) >= 60, 60, 0.2, "the run to get going")
    time.sleep(3.0)
    stop_at = time.time()
    before = _rate(world, ids, stop_at - 3.0, stop_at)
    world.engine.dispose()
    world.services.pg_stop()
    time.sleep(10.0)
    world.services.pg_start()
    up_at = time.time()

    def recovered() -> float | None:
        now = time.time()
        if now - up_at < 2.0:
            return None
        if _rate(world, ids, now - 2.0, now) >= 0.5 * before:
            return now - up_at
        return None

    recovery = wait_until(recovered, 60, 0.5, "throughput to recover to half its rate")
    world.wait_done(ids, 120)
    figures = world.figures(ids)
    record(
        "F6",
        "Postgres stopped 10 s, started",
        request,
        jobs=len(ids),
        **figures.row(),
        worst_recovery=recovery,
        overlaps=world.overlaps(),
        notes=(
            f"{before:.0f} jobs/s before; back to half of it {recovery:.1f} s after the start; "
            f"double claims {figures.double_claims}; {figures.summary()}"
        ),
    )
    assert _alive([roles.schedule, *roles.execution, roles.beat])
    assert figures.lost == 0 and figures.statuses == {"succeeded": len(ids)}
    assert figures.double_claims == 0 and figures.duplicate_effects == 0
    assert world.overlaps() == 0


def _claim_latency(engine: object) -> float:
    """One claim statement (50 rows), rolled back: nothing is taken from the cluster."""
    with engine.connect() as conn:  # type: ignore[attr-defined]
        began = time.perf_counter()
        tx = conn.begin()
        store.claim_due(conn, limit=50, ttl=10.0)
        tx.rollback()
        return time.perf_counter() - began


def _p95(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=20)[-1] if len(samples) >= 2 else samples[0]


@pytest.mark.timeout(150)
def test_f9_idle_in_transaction_is_cut(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    world = make_world(HARVEST_IDLE_IN_TRANSACTION_TIMEOUT_MS="2000")
    world.standard(execution=2, concurrency=2)
    ids = world.enqueue(250, low_ms=20, high_ms=40)
    probe = make_engine(world.settings, pool_size=1)
    idle_engine = make_engine(world.settings, pool_size=1)
    try:
        baseline = [_claim_latency(probe) for _ in range(15)]
        conn = idle_engine.connect()
        conn.begin()
        locked = conn.execute(
            text(
                "SELECT id FROM harvest_jobs WHERE status = 'pending' "
                "ORDER BY priority DESC, run_at, id LIMIT 50 FOR UPDATE"
            )
        ).scalars()
        locked_ids = list(locked)
        backend = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        idle_from = time.monotonic()
        during: list[float] = []
        cut_after: float | None = None
        while time.monotonic() - idle_from < 15:
            during.append(_claim_latency(probe))
            gone = not world.scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = :pid", pid=backend
            )
            if gone:
                cut_after = time.monotonic() - idle_from
                break
            time.sleep(0.05)
        with pytest.raises(DBAPIError):
            conn.execute(text("SELECT 1"))
        conn.invalidate()
        conn.close()
        world.wait_done(ids, 90)
    finally:
        probe.dispose()
        idle_engine.dispose()
    figures = world.figures(ids)
    base, idle = _p95(baseline), _p95(during)
    record(
        "F9",
        "session idle in transaction during load",
        request,
        jobs=len(ids),
        **figures.row(),
        worst_recovery=cut_after,
        overlaps=world.overlaps(),
        notes=(
            f"a harvest session holding {len(locked_ids)} head-of-queue rows FOR UPDATE was "
            f"cut after {cut_after or 0:.1f} s (HARVEST_IDLE_IN_TRANSACTION_TIMEOUT_MS=2000); "
            f"claim p95 {base * 1000:.0f} ms before, {idle * 1000:.0f} ms while it idled"
        ),
    )
    assert len(locked_ids) == 50
    assert cut_after is not None and cut_after < 2.0 + 3.0, "the idle session was not cut"
    # A claim that waited on the idle session's locks would take the full 2 s timeout.
    assert idle <= max(3 * base, base + 0.1), "the claim path slowed behind the idle session"
    assert figures.lost == 0 and figures.statuses == {"succeeded": len(ids)}
    assert figures.duplicate_effects == 0 and figures.double_claims == 0


_SS_PID = re.compile(r"pid=(\d+)")


def _harvest_connections(world: World) -> tuple[int, Counter[int]]:
    """(harvest connections in pg_stat_activity, harvest connections per client pid)."""
    ports = {
        int(r[0])
        for r in world.sql(
            "SELECT client_port FROM pg_stat_activity WHERE application_name = 'harvest' "
            "AND client_port IS NOT NULL"
        )
    }
    out = subprocess.run(
        ["ss", "-Htnp", "state", "established", f"( dport = :{world.services.pg_port} )"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    per_pid: Counter[int] = Counter()
    for line in out.splitlines():
        fields = line.split()
        local = fields[2] if len(fields) > 2 else ""
        match = _SS_PID.search(line)
        if match and local.rsplit(":", 1)[-1].isdigit() and int(local.rsplit(":", 1)[-1]) in ports:
            per_pid[int(match.group(1))] += 1
    return len(ports), per_pid


@pytest.mark.timeout(150)
def test_f10_connections_stay_within_the_documented_budget(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    world = make_world()
    roles = world.standard(execution=2, concurrency=3)
    ids = world.enqueue(150, low_ms=20, high_ms=60)
    stop = threading.Event()

    def enqueue_more() -> None:  # the enqueuing side at full speed too
        while not stop.is_set():
            ids.extend(world.enqueue(5, low_ms=20, high_ms=60))
            time.sleep(0.5)

    feeder = threading.Thread(target=enqueue_more, daemon=True)
    feeder.start()
    peak_total = 0
    peak_per: Counter[int] = Counter()
    try:
        began = time.monotonic()
        while time.monotonic() - began < 8:
            total, per_pid = _harvest_connections(world)
            peak_total = max(peak_total, total)
            for pid, n in per_pid.items():
                peak_per[pid] = max(peak_per[pid], n)
            time.sleep(0.1)
    finally:
        stop.set()
        feeder.join(10)
    world.wait_done(ids, 120)
    settings = world.settings
    per_process = settings.db_pool_size + settings.db_max_overflow
    mains = [roles.schedule, *roles.execution]
    children = [c for p in mains for c in world.cluster.children(p)]
    processes = len(mains) + len(children) + 1 + 1  # + beat + the enqueuing process
    budget = per_process * processes
    figures = world.figures(ids)
    worst = max(peak_per.values(), default=0)
    record(
        "F10",
        "peak Postgres connections, every role busy",
        request,
        jobs=len(ids),
        **figures.row(),
        overlaps=world.overlaps(),
        notes=(
            f"peak {peak_total} harvest connections, budget {budget} = (HARVEST_DB_POOL_SIZE "
            f"{settings.db_pool_size} + HARVEST_DB_MAX_OVERFLOW {settings.db_max_overflow}) x "
            f"{processes} processes; busiest process held {worst} (at most {per_process})"
        ),
    )
    assert peak_total > 0 and peak_per, "no harvest connection was seen"
    assert peak_total <= budget
    assert worst <= per_process
    assert figures.lost == 0 and figures.duplicate_effects == 0
