"""F11: execution workers on two test "hosts" (network namespaces), one cut off for 20 s.

Topology, all made by this test and removed at its end::

    [ns hva] --veth-- +---------------------------+
                      | ns hvs: bridge 10.199.77.1 |  relay -> 127.0.0.1 (private PG, Redis, API)
    [ns hvb] --veth-- +---------------------------+

Host A is 10.199.77.2, host B 10.199.77.3; the only address they reach is 10.199.77.1, where
``tests.chaos.forward`` relays to the suite's private servers on loopback. The schedule worker
and beat stay on the machine's loopback. Cutting host A = its bridge port down (packets dropped,
no reset: a real partition); healing = up again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from harvest.procs import ROOT
from tests.chaos.conftest import World, note_rescues, record, report, victims_of, wait_until
from tests.chaos.report import Row

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

SUBNET = "10.199.77"
CUT_SECONDS = 20.0


@dataclass
class Net:
    services: str  # namespace names
    hosts: dict[str, str]  # host name -> namespace
    ports: dict[str, str]  # host name -> its bridge port (in the services namespace)
    address: str  # where the hosts reach the services

    def cut(self, host: str) -> None:
        _ip("-n", self.services, "link", "set", self.ports[host], "down")

    def heal(self, host: str) -> None:
        _ip("-n", self.services, "link", "set", self.ports[host], "up")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _cannot_make_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); the suite runs unprivileged"
    probe = f"hvprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return f"`ip netns add` failed: {detail.decode(errors='replace').strip() or exc}"
    with contextlib.suppress(subprocess.CalledProcessError):
        _ip("netns", "del", probe)
    return None


@contextlib.contextmanager
def network() -> Iterator[Net]:
    tag = f"{os.getpid() % 100000}"
    services = f"hvs{tag}"
    hosts = {"host-a": f"hva{tag}", "host-b": f"hvb{tag}"}
    ports: dict[str, str] = {}
    made: list[str] = []
    try:
        for ns in (services, *hosts.values()):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", services, "link", "add", "hvbr", "type", "bridge")
        _ip("-n", services, "addr", "add", f"{SUBNET}.1/24", "dev", "hvbr")
        _ip("-n", services, "link", "set", "hvbr", "up")
        for i, (host, ns) in enumerate(hosts.items(), start=2):
            inner, outer = f"hv{tag}{host[-1]}", f"hv{tag}{host[-1]}p"
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "netns", services)
            _ip("-n", services, "link", "set", outer, "master", "hvbr")
            _ip("-n", services, "link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            ports[host] = outer
        yield Net(services, hosts, ports, f"{SUBNET}.1")
    finally:
        for ns in reversed(made):  # deleting a namespace deletes its veth ends too
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", ns)


@contextlib.contextmanager
def relay(net: Net, ports: list[int]) -> Iterator[None]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.chaos.forward", net.services, net.address, *map(str, ports)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert "forwarding" in line, f"the relay did not start: {line}"
        yield
    finally:
        proc.kill()
        proc.wait(10)


def _sockets(ns: str) -> str:
    """TCP sockets of a host (queues and timers), for a failure report."""
    done = subprocess.run(
        ["ip", "netns", "exec", ns, "ss", "-tnpoi"], capture_output=True, text=True, check=False
    )
    return done.stdout


def _executions_on(world: World, host: str, after: float) -> int:
    return int(
        world.scalar(
            "SELECT count(*) FROM chaos_executions WHERE host = :h "
            "AND started_at > to_timestamp(:t)",
            h=host,
            t=after,
        )
    )


@pytest.mark.timeout(240)
def test_f11_one_host_cut_off_for_twenty_seconds(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    reason = _cannot_make_namespaces()
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
                _executions_on(world, "host-a", start) >= 5
                and _executions_on(world, "host-b", start) >= 5
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
                lambda: _executions_on(world, "host-a", healed_at), 60, 0.5, "host A to rejoin"
            )
        except AssertionError:
            print("host A's sockets:", _sockets(net.hosts["host-a"]))
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
