"""The real `harvest web`, under `ulimit -n 1000` (fewer files than it
has clients): 1,000 connections that send half a request
header, opened as fast as eight threads can, do not stop a normal request from being served
within 1 s, never make the server run out of files, and are dropped after the request
timeout."""

from __future__ import annotations

import resource
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from harvest.settings import Settings

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SLOW = 1000
REQUEST_TIMEOUT = 3
AUTH = ("operator", "a-long-test-password")
HALF = b"GET /api/overview HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Basic "


@pytest.fixture
def web(migrated: Settings, tmp_path: Path) -> Iterator[str]:
    """`harvest web` as a user starts it, in a process that may open 1000 files at most."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < SLOW + 200:
        pytest.skip(f"the open-file hard limit ({hard}) is too low for {SLOW} client sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, SLOW + 200), hard))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        "HARVEST_DATABASE_URL": migrated.database_url,
        "HARVEST_REDIS_URL": migrated.redis_url,
        "HARVEST_WEB_USER": AUTH[0],
        "HARVEST_WEB_PASSWORD": AUTH[1],
        "PATH": "/usr/bin:/bin",
    }
    log = (tmp_path / "web.log").open("wb")
    command = [sys.executable, "-m", "harvest.cli", "web", "--port", str(port),
               "--request-timeout", str(REQUEST_TIMEOUT)]  # fmt: skip
    proc = subprocess.Popen(
        ["sh", "-c", 'ulimit -n 1000 && exec "$@"', "sh", *command],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{url}/api/csrf", auth=AUTH, timeout=5).raise_for_status()
            break
        except httpx.TransportError:
            assert proc.poll() is None, (tmp_path / "web.log").read_text()
            assert time.monotonic() < deadline, "harvest web did not start"
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(15)
    log.close()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_half_sent_requests_do_not_stop_a_normal_one(web: str, tmp_path: Path) -> None:
    port = int(web.rsplit(":", 1)[1])
    slow: list[socket.socket] = []

    def connect(_: int) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        slow.append(sock)
        sock.sendall(HALF)

    try:
        # Many at once, so that the server accepts them in full bursts (files it must budget).
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(connect, range(SLOW)))
        with httpx.Client(base_url=web, auth=AUTH, timeout=10) as client:
            started = time.monotonic()
            # A request with no database work, so that the time is the server's own: what
            # slow clients could cost (asyncio pauses accepting for a whole second on EMFILE)
            # and not how long the overview's counts take on a loaded machine (1.02 s once).
            response = client.get("/api/csrf")
            took = time.monotonic() - started
        assert response.status_code == 200
        assert took < 1.0, f"a normal request took {took:.2f} s beside {SLOW} slow clients"
        # Out of files, asyncio stops accepting anyone for a second ("out of system resource").
        assert "Too many open files" not in (tmp_path / "web.log").read_text()
        # Every slow client is dropped: by the request timeout, or earlier to make room.
        assert _all_closed(slow, within=REQUEST_TIMEOUT + 10) == SLOW
    finally:
        for sock in slow:
            sock.close()


def _all_closed(socks: list[socket.socket], *, within: float) -> int:
    """How many of ``socks`` the server closed (EOF or reset) within ``within`` seconds."""
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    closed = 0
    deadline = time.monotonic() + within
    while closed < len(socks) and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=0.5):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(4096)
            except ConnectionResetError:
                data = b""
            if not data:
                selector.unregister(sock)
                closed += 1
    selector.close()
    return closed
