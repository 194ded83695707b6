"""Killing workers under load, measured the same way for every case that does it (F1 on sync
workers, F12 on async ones): SIGKILL a random execution child every 2-3.5 s (every fifth kill
a whole worker, children and all, replaced at once) until the backlog nearly drains; then check
that every job succeeded exactly once in effect, no key was ever held past its limit, and every
interrupted job was taken back."""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from tests.chaos.conftest import Victim, World, note_rescues, record, victims_of


@dataclass
class KillRun:
    kills: dict[str, int] = field(default_factory=lambda: {"child": 0, "main": 0})
    victims: list[Victim] = field(default_factory=list)
    under_fire: float = 0.0
    restarted: int = 0  # workers that exited on their own and were started again


def kill_under_load(
    world: World,
    ids: list[int],
    executions: list[subprocess.Popen[bytes]],
    replace: Callable[[], subprocess.Popen[bytes]],
    *,
    cap: float,
    seed: int = 1,
) -> KillRun:
    rng = random.Random(seed)
    run = KillRun()
    started = time.monotonic()
    next_kill = started + rng.uniform(2.0, 3.5)
    # Kill until the backlog is nearly drained: every stretch of the run is under fire.
    while time.monotonic() - started < cap:
        time.sleep(0.2)
        note_rescues(world, run.victims)
        if len(ids) - world.succeeded_count(ids) < 50:
            break
        # A supervisor's part: a worker whose child was killed while its pool was still
        # starting exits ("Could not start worker processes"); start it again, as systemd would.
        for proc in [p for p in executions if p.poll() is not None]:
            executions.remove(proc)
            executions.append(replace())
            run.restarted += 1
        if time.monotonic() < next_kill:
            continue
        next_kill = time.monotonic() + rng.uniform(2.0, 3.5)
        if sum(run.kills.values()) % 5 == 4:  # now and then a main worker process
            victim = rng.choice(executions)
            pids = [victim.pid, *world.cluster.children(victim)]
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(10)
            executions.remove(victim)
            executions.append(replace())
            run.kills["main"] += 1
        else:
            children = [c for proc in executions for c in world.cluster.children(proc)]
            if not children:
                continue
            pids = [rng.choice(children)]
            try:
                os.kill(pids[0], signal.SIGKILL)
            except ProcessLookupError:  # it ended between the listing and the kill: next one
                continue
            run.kills["child"] += 1
        killed_at = time.monotonic()
        time.sleep(0.1)  # a child SIGKILLed with its main process dies a moment later
        run.victims += victims_of(world, killed_at, pids=pids)
    run.under_fire = time.monotonic() - started
    deadline = time.monotonic() + 30  # the last kills' victims: rescue times measured live
    while any(v.rescued_after is None for v in run.victims) and time.monotonic() < deadline:
        time.sleep(0.2)
        note_rescues(world, run.victims)
    return run


def record_kills(
    case: str,
    title: str,
    request: pytest.FixtureRequest,
    world: World,
    ids: list[int],
    run: KillRun,
    workload: str,
) -> None:
    """Wait for every job, record the case's row, and assert what a user would notice."""
    world.wait_done(ids, 180)
    figures = world.figures(ids)
    rescues = [v.rescued_after for v in run.victims if v.rescued_after is not None]
    rerun = world.scalar(
        "SELECT max(extract(epoch FROM b.started_at - a.started_at)) FROM chaos_executions a "
        "JOIN chaos_executions b ON b.job_id = a.job_id AND b.attempt = a.attempt + 1 "
        "WHERE a.job_id = ANY(:ids)",
        ids=ids,
    )
    kills = run.kills
    record(
        case,
        title,
        request,
        jobs=len(ids),
        **figures.row(),
        worst_recovery=max(rescues, default=None),
        overlaps=world.overlaps(),
        notes=(
            f"{kills['child']} children + {kills['main']} main processes SIGKILLed in "
            f"{run.under_fire:.0f} s ({run.restarted} workers that exited on their own started "
            f"again), {len(run.victims)} running jobs interrupted; kill-to-rescue "
            f"median {statistics.median(rescues or [0]):.1f} s, worst shown (lease 3 s, rescue "
            f"every 1 s); worst attempt-to-next-attempt {float(rerun or 0):.0f} s (rescued jobs "
            f"keep their place in the queue); {figures.summary()}; {workload}"
        ),
    )
    assert sum(kills.values()) >= run.under_fire / 4, "fewer kills than planned"
    assert figures.statuses == {"succeeded": len(ids)}
    assert figures.lost == 0 and figures.effects == len(ids)
    assert figures.duplicate_effects == 0 and figures.double_claims == 0
    assert world.overlaps() == 0
    assert run.victims, "no kill interrupted a job: nothing was measured"
    assert len(rescues) == len(run.victims), "an interrupted job was never taken back"
