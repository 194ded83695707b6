"""The server's own bounds (harvest.web.serve): a request deadline, idle keep-alive and a
connection limit; a slow client is dropped, the others are served."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from harvest.app import Harvest
from harvest.settings import Settings
from harvest.web import create_app, serve
from tests.web.conftest import Server

TIMEOUT = 1.0
HALF = b"GET /api/csrf HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


@pytest.fixture
def server(migrated: Settings, harvest: Harvest) -> Iterator[Server]:
    app = create_app(migrated, credentials=None, harvest=harvest)
    with Server(app, request_timeout=TIMEOUT, max_connections=16) as running:
        yield running


def _connect(server: Server, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    if first:
        sock.sendall(first)
    return sock


def _open(sock: socket.socket) -> bool:
    """True while the server has not closed ``sock`` (nothing to read, no EOF)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        sock.setblocking(True)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def _served(server: Server) -> bool:
    with httpx.Client(base_url=server.url, timeout=5) as client:
        return client.get("/api/csrf").status_code == 200


def test_a_half_sent_request_is_dropped_and_others_are_served(server: Server) -> None:
    slow = _connect(server, HALF)
    silent = _connect(server)  # connects and sends nothing at all
    assert _served(server)
    assert _open(slow) and _open(silent)
    assert _closed_within(slow, TIMEOUT + 3) and _closed_within(silent, 1)
    slow.close()
    silent.close()


def test_trickling_bytes_does_not_keep_a_connection(server: Server) -> None:
    # One full request answered, then the next one sent a byte every 0.1 s: the bytes keep
    # coming, but the request is not complete within the deadline.
    sock = _connect(server, HALF + b"x\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    started = time.monotonic()
    dropped = False
    try:
        for byte in HALF * 4:
            sock.sendall(bytes([byte]))
            time.sleep(0.1)
            if time.monotonic() - started > TIMEOUT + 3:
                break
    except (BrokenPipeError, ConnectionResetError):
        dropped = True
    assert dropped or _closed_within(sock, 1)
    sock.close()


def test_a_body_not_sent_in_time_is_dropped(server: Server) -> None:
    sock = _connect(
        server,
        b"POST /api/dead/retry HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        b"\r\nContent-Length: 100\r\n\r\n{",
    )
    assert _closed_within(sock, TIMEOUT + 3)
    sock.close()
    assert _served(server)


def test_at_the_connection_limit_the_longest_waiting_client_makes_room(
    migrated: Settings, harvest: Harvest
) -> None:
    app = create_app(migrated, credentials=None, harvest=harvest)
    with Server(app, request_timeout=60, max_connections=16) as server:
        _limit(server)


def _limit(server: Server) -> None:
    slow = [_connect(server, HALF)]
    time.sleep(0.05)  # the first one is the oldest
    slow += [_connect(server, HALF) for _ in range(15)]
    time.sleep(0.2)
    assert all(_open(s) for s in slow)  # 16 connections: at the limit, none dropped
    assert _served(server)  # the 17th is served ...
    assert _closed_within(slow[0], 2)  # ... by dropping the one that waited longest
    assert all(_open(s) for s in slow[1:])
    for s in slow:
        s.close()


def test_the_kernel_queues_many_more_connections_than_one_accept_burst(server: Server) -> None:
    """A flood of connections waits in the kernel's accept queue (served in turn) instead of
    overflowing it: an overflow drops a client's SYN, and its connect waits a second."""
    ss = shutil.which("ss")
    if ss is None:
        pytest.skip("ss (iproute2) is not installed")
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    listing = subprocess.run(
        [ss, "-ltnH", f"sport = :{server.port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    queue = int(listing[2])  # State Recv-Q Send-Q ...: a listening socket's Send-Q is its backlog
    assert queue == min(serve.LISTEN_BACKLOG, somaxconn) > serve.BACKLOG
