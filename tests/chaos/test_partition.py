"""F11: execution workers on two test "hosts" (network namespaces, see ``tests.chaos.netns``),
one cut off for 20 s. Host A is 10.199.77.2, host B 10.199.77.3; the schedule worker and beat
stay on the machine's loopback."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.chaos.conftest import World, note_rescues, record, report, victims_of, wait_until
from tests.chaos.netns import cannot_make_namespaces, executions_on, network, relay, sockets
from tests.chaos.report import Row

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

CUT_SECONDS = 20.0


@pytest.mark.timeout(240)
def test_f11_one_host_cut_off_for_twenty_seconds(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    reason = cannot_make_namespaces()
    if reason:
        report().add(Row("F11", "a host cut off 20 s", outcome="skipped", notes=reason))
        pytest.skip(reason)
    # A session idle in transaction on the cut host would hold its rows' locks (rescue skips
    # locked rows) until the server's idle-in-transaction timeout: 5 s here (default 60 s).
    world = make_world(HARVEST_IDLE_IN_TRANSACTION_TIMEOUT_MS="5000")
    svc = world.services
    api_port = int(world.url.rsplit(":", 1)[1].split("/", 1)[0])
    with network() as net, relay(net, [svc.pg_port, svc.redis_port, api_port]):
        remote = {
            "HARVEST_DATABASE_URL": svc.database_url.replace("127.0.0.1", net.address),
            "HARVEST_REDIS_URL": svc.redis_url.replace("127.0.0.1", net.address),
        }
        url = world.url.replace("127.0.0.1", net.address)
        world.cluster.worker("schedule", concurrency=1)
        world.cluster.beat()
        for host, ns in net.hosts.items():
            world.cluster.worker("execution", concurrency=2, netns=ns, CHAOS_HOST=host, **remote)
        world.cluster.wait_ready()
        ids = world.enqueue(80, url=url)
        start = time.time()
        wait_until(
            lambda: (
                executions_on(world, "host-a", start) >= 5
                and executions_on(world, "host-b", start) >= 5
            ),
            60,
            0.2,
            "both hosts to run jobs",
        )
        ids += world.enqueue(8, url=url, seconds=4.0)  # long jobs: host A is surely mid-job
        wait_until(
            lambda: world.scalar(
                "SELECT count(*) FROM chaos_executions WHERE host = 'host-a' "
                "AND ended_at IS NULL AND job_id = ANY(:ids)",
                ids=ids[-8:],
            ),
            60,
            0.1,
            "host A to run a long job",
        )
        net.cut("host-a")
        cut_at = time.monotonic()
        time.sleep(0.5)  # what host A had started before the cut is all it ever logged
        victims = victims_of(world, cut_at, host="host-a")
        for _ in range(8):  # a steady trickle of new work for host B meanwhile
            ids += world.enqueue(10, url=url)
            note_rescues(world, victims)
            time.sleep(1.0)
        while time.monotonic() - cut_at < CUT_SECONDS:
            note_rescues(world, victims)
            time.sleep(0.2)
        net.heal("host-a")
        rescued_in_cut = [v.rescued_after for v in victims if v.rescued_after is not None]
        healed_at = time.time()
        ids += world.enqueue(60, url=url)
        try:
            rejoined = wait_until(
                lambda: executions_on(world, "host-a", healed_at), 60, 0.5, "host A to rejoin"
            )
        except AssertionError:
            print("host A's sockets:", sockets(net.hosts["host-a"]))
            raise
        rejoin_after = (
            float(
                world.scalar(
                    "SELECT extract(epoch FROM min(started_at)) FROM chaos_executions "
                    "WHERE host = 'host-a' AND started_at > to_timestamp(:t)",
                    t=healed_at,
                )
            )
            - healed_at
        )
        world.wait_done(ids, 90)
        time.sleep(2.0)  # host A's stale handlers come back and try to write
    figures = world.figures(ids)
    stale = world.scalar(
        "SELECT count(*) FROM chaos_executions WHERE host = 'host-a' AND job_id = ANY(:ids) "
        "AND (outcome = 'stale' OR outcome LIKE 'error LeaseLost%')",
        ids=[v.job_id for v in victims],
    )
    effects_by = dict(
        world.sql(
            "SELECT host, count(*) FROM chaos_effects WHERE job_id = ANY(:ids) GROUP BY host",
            ids=[v.job_id for v in victims],
        )
    )
    record(
        "F11",
        "a host cut off 20 s, healed",
        request,
        jobs=len(ids),
        **figures.row(),
        worst_recovery=max(rescued_in_cut, default=None),
        overlaps=world.overlaps(),
        notes=(
            f"netns hosts A and B (2 processes each) behind a bridge; {len(victims)} jobs "
            f"running on A at the cut, {len(rescued_in_cut)} taken back during it (worst "
            f"shown), their effects written by {', '.join(sorted(effects_by))}; A ran jobs again "
            f"{rejoin_after:.1f} s after the heal ({rejoined} since); A's interrupted attempts "
            f"refused on their return (LeaseLost or the fence): {stale}; {figures.summary()}"
        ),
    )
    assert victims, "nothing was running on host A when it was cut"
    assert len(rescued_in_cut) == len(victims), "a job of the cut host was not taken back"
    assert "host-a" not in effects_by, "the cut host's stale attempt wrote an effect"
    assert figures.lost == 0 and figures.statuses == {"succeeded": len(ids)}
    assert figures.duplicate_effects == 0 and figures.double_claims == 0
    assert world.overlaps() == 0
