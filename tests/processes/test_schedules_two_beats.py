"""An every-second schedule under two beats and two schedule workers for 60 s, with the leader
beat paused (SIGSTOP) and resumed midway: exactly one job per fire time, and no gap."""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from harvest.app import Harvest
from harvest.settings import Settings
from tests.processes.conftest import Cluster, wait_until

pytestmark = pytest.mark.slow

SENT = re.compile(r"Scheduler: Sending due task harvest-schedules")
RAN = re.compile(r"Task harvest\.schedules\[[^\]]+\] succeeded")


def count(path: Path, pattern: re.Pattern[str]) -> int:
    return len(pattern.findall(path.read_text(errors="replace")))


def test_two_beats_two_schedule_workers_one_job_per_fire_time(
    migrated: Settings, clean_db: Engine, redis_client: object, tmp_path: Path, client_app: Harvest
) -> None:
    client_app.schedule(
        "every-second", "tick", every=1, payload={"schedule": "every-second"},
        misfire="catch_up", catch_up=30,
    )  # fmt: skip
    cluster = Cluster(migrated, tmp_path)
    cluster.env["HARVEST_LEADER_TTL"] = "2"
    try:
        cluster.worker("schedule", concurrency=1)
        cluster.worker("schedule", concurrency=1)
        cluster.worker("execution", concurrency=2)
        first, second = cluster.beat(), cluster.beat()
        beats = sorted(tmp_path.glob("beat-*.log"))
        started = time.monotonic()
        wait_until(lambda: sum(count(p, SENT) for p in beats) >= 5, 30, 0.2, "beat ticks")
        time.sleep(max(0.0, started + 12 - time.monotonic()))

        sends = [count(p, SENT) for p in beats]
        assert min(sends) == 0, sends  # one leader sends, the other stands by
        leader, standby_log = (first, beats[1]) if sends[0] else (second, beats[0])
        os.killpg(leader.pid, signal.SIGSTOP)  # the leader hangs past its TTL
        wait_until(lambda: count(standby_log, SENT) >= 3, 30, 0.2, "the standby to take over")
        time.sleep(4)
        os.killpg(leader.pid, signal.SIGCONT)

        time.sleep(max(0.0, started + 32 - time.monotonic()))
        stopped = client_app.pause_schedule("every-second")
        workers = sorted(tmp_path.glob("worker-schedule-*.log"))
        ran = [count(p, RAN) for p in workers]
    except AssertionError:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()

    assert all(n > 5 for n in ran), f"both schedule workers fire schedules: {ran}"
    with clean_db.connect() as conn:
        jobs = conn.execute(
            text(
                "SELECT run_at, count(*) AS n, min(payload::text) AS payload "
                "FROM harvest_jobs WHERE name = 'tick' GROUP BY run_at ORDER BY run_at"
            )
        ).all()
        fires = conn.execute(
            text(
                "SELECT f.fire_at, j.run_at FROM harvest_schedule_fires f "
                "LEFT JOIN harvest_jobs j ON j.id = f.job_id ORDER BY f.fire_at"
            )
        ).all()
    assert {j.n for j in jobs} == {1}, "a fire time got more than one job"
    times = [j.run_at for j in jobs]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)]
    assert set(gaps) == {1.0}, f"gaps in the fire times: {sorted(set(gaps))}"
    assert len(times) >= 27, len(times)
    assert [f.fire_at for f in fires] == times
    assert all(f.run_at == f.fire_at for f in fires)
    assert {j.payload for j in jobs} == {'{"schedule": "every-second"}'}
    assert stopped.last_fired_at == times[-1]
