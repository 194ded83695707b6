"""F12: F1's kills against async workers under load: hundreds of async jobs in flight on each
worker's event loop, calling the API through a wide key pool, while children and whole workers
are SIGKILLed."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from tests.chaos import jobs as chaos_jobs
from tests.chaos.conftest import World
from tests.chaos.kills import kill_under_load, record_kills

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

F12_JOBS = int(os.environ.get("CHAOS_F12_JOBS", "3000"))
F12_CAP = 300.0
WIDE_KEYS, WIDE_CONCURRENCY = 16, 16  # 256 calls at once at most


@pytest.mark.timeout(540)
def test_f12_sigkill_async_workers_with_hundreds_in_flight(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    world = make_world()
    world.add_keys(WIDE_KEYS, concurrency=WIDE_CONCURRENCY, pool=chaos_jobs.WIDE)
    roles = world.standard(execution=2, concurrency=2)
    ids = world.enqueue(F12_JOBS, name="chaos.awork", url=world.url, low_ms=200, high_ms=1000)
    run = kill_under_load(
        world,
        ids,
        list(roles.execution),
        lambda: world.cluster.worker("execution", concurrency=2),
        cap=F12_CAP,
        seed=12,
    )
    spans = world.sql(  # executions that ended (a killed one never records its end)
        "SELECT extract(epoch FROM started_at), extract(epoch FROM ended_at) "
        "FROM chaos_executions WHERE job_id = ANY(:ids) AND ended_at IS NOT NULL",
        ids=ids,
    )
    most = max_at_once([(float(a), float(b)) for a, b in spans])
    record_kills(
        "F12",
        "SIGKILL async workers under load",
        request,
        world,
        ids,
        run,
        f"async jobs wait 200-1000 ms then call through {WIDE_KEYS} keys x {WIDE_CONCURRENCY} "
        f"leases; 2 workers x 2 children x 100 async jobs; up to {most} executions overlapped",
    )


def max_at_once(spans: list[tuple[float, float]]) -> int:
    """The most executions in flight at one instant (a sweep over their starts and ends)."""
    level = best = 0
    for _, step in sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans]):
        level += step
        best = max(best, level)
    return best
