"""How ``harvest web`` is served: uvicorn (h11), with bounds uvicorn does not have on its own.

uvicorn times out only idle keep-alive connections, and its timer is cancelled by every byte
received: a client that connects and sends half a request header (or one byte now and then)
holds its connection, and a file descriptor, for as long as it likes. Here each connection is
an h11 protocol with:

* a request deadline (``request_timeout``, default 10 s): from the connection (or the first
  byte of the next request on a kept-alive one) to the last byte of the request's headers and
  body; a client that has not sent them all by then is dropped;
* idle keep-alive: 5 s between requests (uvicorn's own timer);
* a connection limit (``max_connections``, default 1000, and never more than the open-file
  limit leaves room for: the soft limit is raised towards the hard one at start): a
  connection beyond it makes room by dropping the connection that has waited longest on its
  client (a request not fully sent, or idle keep-alive); when every connection is being
  answered, the new one is closed instead.

Requests being answered are never dropped by these bounds; headers are at most 16 KiB (h11).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("harvest.web")

REQUEST_TIMEOUT = 10.0  # seconds to receive a request's headers and body
KEEP_ALIVE = 5  # seconds an idle kept-alive connection stays open
MAX_CONNECTIONS = 1000
FD_RESERVE = 100  # open files kept for the database pool, Redis, logs, ...
# The listen backlog, which is also the most connections asyncio accepts in one go before any
# of them can make room: the connection limit leaves that many files free as well, so that the
# process never runs out of them (on EMFILE asyncio stops accepting for a whole second).
BACKLOG = 128
FD_WANTED = 65536  # the soft open-file limit asked for at start (never above the hard one)
_WAITING = (h11.IDLE, h11.SEND_BODY)  # the client still owes us (part of) a request


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a request deadline and a connection limit."""

    request_timeout: float = REQUEST_TIMEOUT
    max_connections: int = MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_since = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state in _WAITING:
            self._arm()  # the first byte of another request on a kept-alive connection
        super().data_received(data)
        if self._deadline is not None and self.conn.their_state not in _WAITING:
            self._disarm()  # the whole request is in: from here on, it is ours to answer

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._waiting_since = self.loop.time()  # idle keep-alive from now

    def waiting_on_client(self) -> bool:
        """True while the client owes a request (or idles between two)."""
        return self._deadline is not None or self.timeout_keep_alive_task is not None

    def _arm(self) -> None:
        self._disarm()
        self._waiting_since = self.loop.time()
        self._deadline = self.loop.call_later(self.request_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        self.drop(f"its request was not received within {self.request_timeout:.0f} s")

    def drop(self, why: str) -> None:
        if not self.transport.is_closing():
            log.debug("dropped the connection of %s: %s", self.client, why)
            self.transport.close()

    def _make_room(self) -> None:
        others = [
            c
            for c in self.connections
            if isinstance(c, GuardedH11) and c is not self and c.waiting_on_client()
            and not c.transport.is_closing()
        ]  # fmt: skip
        if others:
            min(others, key=lambda c: c._waiting_since).drop("the connection limit was reached")
        else:
            self.drop("the connection limit was reached and every connection is being answered")


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit towards its hard limit; returns the soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = FD_WANTED if hard == resource.RLIM_INFINITY else min(FD_WANTED, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else FD_WANTED


def protocol(*, request_timeout: float, max_connections: int) -> type[GuardedH11]:
    """The protocol class for these bounds (uvicorn makes one instance per connection)."""
    room = max(16, raise_open_file_limit() - FD_RESERVE - BACKLOG)
    bounds = {"request_timeout": request_timeout, "max_connections": min(max_connections, room)}
    return type("GuardedH11", (GuardedH11,), bounds)


def config(
    app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8080,
    request_timeout: float = REQUEST_TIMEOUT,
    max_connections: int = MAX_CONNECTIONS,
    **options: Any,
) -> uvicorn.Config:
    """uvicorn's configuration for the dashboard ``app`` with the bounds above."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol(request_timeout=request_timeout, max_connections=max_connections),
        timeout_keep_alive=KEEP_ALIVE,
        backlog=BACKLOG,
        server_header=False,
        **options,
    )
