"""Test "hosts" for the chaos suite: network namespaces behind one bridge (F11, F13).

Topology, all made by :func:`network` and removed when it exits::

    [ns hva] --veth-- +----------------------------+
    [ns hvb] --veth-- | ns hvs: bridge 10.199.77.1 |  relay -> 127.0.0.1 (private services)
       ...   --veth-- +----------------------------+

Host ``host-a`` is 10.199.77.2, ``host-b`` 10.199.77.3, and so on; the only address they reach
is 10.199.77.1, where ``tests.chaos.forward`` relays to the suite's private servers on loopback.
Cutting a host = its bridge port down (packets dropped, no reset: a real partition); healing =
up again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from harvest.procs import ROOT
from tests.chaos.conftest import World

SUBNET = "10.199.77"


@dataclass
class Net:
    services: str  # namespace names
    hosts: dict[str, str]  # host name -> namespace
    ports: dict[str, str]  # host name -> its bridge port (in the services namespace)
    address: str  # where the hosts reach the services

    def cut(self, host: str) -> None:
        ip("-n", self.services, "link", "set", self.ports[host], "down")

    def heal(self, host: str) -> None:
        ip("-n", self.services, "link", "set", self.ports[host], "up")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def cannot_make_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); the suite runs unprivileged"
    probe = f"hvprobe{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return f"`ip netns add` failed: {detail.decode(errors='replace').strip() or exc}"
    with contextlib.suppress(subprocess.CalledProcessError):
        ip("netns", "del", probe)
    return None


@contextlib.contextmanager
def network(names: tuple[str, ...] = ("host-a", "host-b")) -> Iterator[Net]:
    """One namespace per host (``host-<letter>``), each linked to the services' bridge."""
    tag = f"{os.getpid() % 100000}"
    services = f"hvs{tag}"
    hosts = {host: f"hv{host[-1]}{tag}" for host in names}
    ports: dict[str, str] = {}
    made: list[str] = []
    try:
        for ns in (services, *hosts.values()):
            ip("netns", "add", ns)
            made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", services, "link", "add", "hvbr", "type", "bridge")
        ip("-n", services, "addr", "add", f"{SUBNET}.1/24", "dev", "hvbr")
        ip("-n", services, "link", "set", "hvbr", "up")
        for i, (host, ns) in enumerate(hosts.items(), start=2):
            inner, outer = f"hv{tag}{host[-1]}", f"hv{tag}{host[-1]}p"
            ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", outer, "netns", services)
            ip("-n", services, "link", "set", outer, "master", "hvbr")
            ip("-n", services, "link", "set", outer, "up")
            ip("-n", ns, "addr", "add", f"{SUBNET}.{i}/24", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
            ports[host] = outer
        yield Net(services, hosts, ports, f"{SUBNET}.1")
    finally:
        for ns in reversed(made):  # deleting a namespace deletes its veth ends too
            with contextlib.suppress(subprocess.CalledProcessError):
                ip("netns", "del", ns)


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


def sockets(ns: str) -> str:
    """TCP sockets of a host (queues and timers), for a failure report."""
    done = subprocess.run(
        ["ip", "netns", "exec", ns, "ss", "-tnpoi"], capture_output=True, text=True, check=False
    )
    return done.stdout


def executions_on(world: World, host: str, after: float) -> int:
    return int(
        world.scalar(
            "SELECT count(*) FROM chaos_executions WHERE host = :h "
            "AND started_at > to_timestamp(:t)",
            h=host,
            t=after,
        )
    )
