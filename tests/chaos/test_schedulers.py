"""Two beats and two schedule workers: the leader beat paused past its TTL and resumed (F8)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from datetime import datetime

import pytest

from tests.chaos.conftest import World, record, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

SENT = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): INFO/MainProcess\] Scheduler: Sending"
)


def _sends(world: World, beat: subprocess.Popen[bytes]) -> list[float]:
    """Epoch times at which this beat sent a task (its log's local-time stamps)."""
    stamps = []
    for line in world.cluster.log(beat).splitlines():
        match = SENT.match(line)
        if match:
            at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            stamps.append(at.timestamp())
    return stamps


@pytest.mark.timeout(150)
def test_f8_two_schedulers_leader_paused_and_resumed(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    world = make_world(HARVEST_LEADER_TTL="3")
    cluster = world.cluster
    cluster.worker("schedule", concurrency=1)
    cluster.worker("schedule", concurrency=1)
    cluster.worker("execution", concurrency=2)
    beats = [cluster.beat(), cluster.beat()]
    cluster.wait_ready()
    world.client.schedule("chaos-every-second", "chaos.tick", every=1, payload={"schedule": "f8"})
    leader = wait_until(
        lambda: next((b for b in beats if _sends(world, b)), None), 20, 0.2, "a leader to send"
    )
    standby = beats[1 - beats.index(leader)]
    time.sleep(3.0)
    os.killpg(leader.pid, signal.SIGSTOP)
    paused_at = time.time()
    try:
        wait_until(lambda: any(t > paused_at for t in _sends(world, standby)), 20, 0.1, "takeover")
        took_over = min(t for t in _sends(world, standby) if t > paused_at) - paused_at
        time.sleep(2.0)
    finally:
        os.killpg(leader.pid, signal.SIGCONT)
    resumed_at = time.time()
    time.sleep(4.0)
    world.client.pause_schedule("chaos-every-second")
    time.sleep(1.5)  # the last fired ticks reach a worker
    ticks = world.sql(
        "SELECT id, run_at, status FROM harvest_jobs WHERE name = 'chaos.tick' ORDER BY run_at"
    )
    ids = [int(r.id) for r in ticks]
    world.wait_done(ids, 30)
    fires = [r.run_at for r in ticks]
    double = len(fires) - len(set(fires))
    span = (max(fires) - min(fires)).total_seconds() if fires else 0.0
    missing = round(span) + 1 - len(set(fires)) if fires else 0
    stale_sends = [t for t in _sends(world, leader) if t > resumed_at + 1.0]
    both = [t for t in _sends(world, leader) if t > paused_at]
    record(
        "F8",
        "two schedulers, leader paused and resumed",
        request,
        jobs=len(ids),
        lost=len(ids) - world.succeeded_count(ids),
        duplicate_effects=double,
        duplicate_executions=double,
        worst_recovery=took_over,
        notes=(
            f"2 beats (leader TTL 3 s) + 2 schedule workers, a schedule every 1 s: "
            f"{len(set(fires))} fire times, {double} fired twice, {missing} missed; standby "
            f"sent {took_over:.1f} s after the pause; the resumed ex-leader sent "
            f"{len(both)} ticks after resuming ({len(stale_sends)} after 1 s)"
        ),
    )
    assert len(fires) >= 8
    assert double == 0, "a fire time enqueued two jobs"
    assert missing == 0, "fire times were skipped while the leader was paused"
    assert not stale_sends, "the resumed ex-leader kept sending"
