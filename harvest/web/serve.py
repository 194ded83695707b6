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

It always runs on asyncio's own event loop (uvloop, when some other package installs it,
accepts differently), because the open-file budget follows asyncio's accept loop: each time the
listening socket is readable, asyncio accepts up to ``backlog`` connections at once, and a
connection reaches ``connection_made`` two loop iterations after its ``accept`` and is closed
one iteration after it is dropped. So up to three bursts are open beyond the connection limit
at any moment, and that many files are kept free: a process that runs out of them gets EMFILE,
and asyncio then stops accepting anyone for a whole second. The kernel's queue of connections
waiting to be accepted is longer (:data:`LISTEN_BACKLOG`) than one burst: when it is full, a
new client's SYN is dropped and its connect waits a second for the retransmission.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from collections import OrderedDict
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("harvest.web")

REQUEST_TIMEOUT = 10.0  # seconds to receive a request's headers and body
KEEP_ALIVE = 5  # seconds an idle kept-alive connection stays open
MAX_CONNECTIONS = 1000
FD_RESERVE = 100  # open files kept for the database pool, Redis, logs, ...
# The most connections asyncio accepts in one go (the ``backlog`` it is given); three such
# bursts are open beyond the connection limit at worst (see the module's text), and the limit
# leaves files free for them.
BACKLOG = 128
ACCEPT_BURSTS = 3
LISTEN_BACKLOG = 4096  # the kernel's accept queue (capped by net.core.somaxconn)
FD_WANTED = 65536  # the soft open-file limit asked for at start (never above the hard one)
_WAITING = (h11.IDLE, h11.SEND_BODY)  # the client still owes us (part of) a request


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a request deadline and a connection limit."""

    request_timeout: float = REQUEST_TIMEOUT
    max_connections: int = MAX_CONNECTIONS
    # The connections that may be waiting on their client, longest-waiting first (one per
    # protocol class, that is per server: see :func:`protocol`). A connection moves to the end
    # each time it starts waiting; one that is being answered or closing is taken out when
    # it reaches the front. Making room is then O(1), not a scan of every connection.
    _queue: OrderedDict[GuardedH11, None] = OrderedDict()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._queue.pop(self, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state in _WAITING:
            self._arm()  # the first byte of another request on a kept-alive connection
        super().data_received(data)
        if self._deadline is not None and self.conn.their_state not in _WAITING:
            self._disarm()  # the whole request is in: from here on, it is ours to answer

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._wait()  # idle keep-alive from now

    def waiting_on_client(self) -> bool:
        """True while the client owes a request (or idles between two)."""
        return self._deadline is not None or self.timeout_keep_alive_task is not None

    def _arm(self) -> None:
        self._disarm()
        self._wait()
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

    def _wait(self) -> None:
        self._queue[self] = None
        self._queue.move_to_end(self)

    def _make_room(self) -> None:
        queue = self._queue
        while queue:
            longest, _ = queue.popitem(last=False)
            if longest is self:  # no other connection waits on its client
                break
            if longest.waiting_on_client() and not longest.transport.is_closing():
                longest.drop("the connection limit was reached")
                return
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
    room = max(16, raise_open_file_limit() - FD_RESERVE - ACCEPT_BURSTS * BACKLOG)
    bounds = {
        "request_timeout": request_timeout,
        "max_connections": min(max_connections, room),
        "_queue": OrderedDict(),
    }
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
        loop="asyncio",
        server_header=False,
        **options,
    )


class Server(uvicorn.Server):
    """uvicorn's server, with the kernel's accept queue lengthened once it listens.

    asyncio gives its ``backlog`` both to ``listen()`` and to its accept loop; the accept loop's
    burst is what the open-file budget counts, so the queue is lengthened afterwards (a second
    ``listen()`` on a listening socket changes only its backlog)."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for listening in server.sockets:
                sock = socket.socket(fileno=listening.fileno())
                try:
                    sock.listen(LISTEN_BACKLOG)
                finally:
                    sock.detach()  # the fd stays asyncio's
