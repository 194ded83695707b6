"""Worker-side resources: reusable clients per API key (pooled for sync jobs, shared on the
event loop for async ones).

An HTTP client holds connections (TLS handshakes are the slow part of calling an API), so a
worker keeps clients per key and hands them to the jobs that lease that key: as many as are
borrowed at once (the worker's jobs borrow only while holding a lease on the key, so the key's
concurrency bounds them) or a fixed number (``max_per_key``); checked before reuse, closed
after sitting idle.
"""

from __future__ import annotations

import os
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx

C = TypeVar("C")

_TLS: dict[int, ssl.SSLContext] = {}  # process id -> its one TLS context for the keys' clients
_TLS_LOCK = threading.Lock()


def tls_context() -> ssl.SSLContext:
    """This process's TLS context for the keys' HTTP clients: what httpx makes for each client
    by default (certifi's CA bundle, or ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` when set), made
    once a process instead of once a client. Loading the CA bundle is 30-37 ms of CPU, and a
    worker makes a client for every key and, on a thread pool, for every call on a key at once:
    256 clients were 9 s of CPU for a ``-P threads -c 256`` worker (a context is safe to share
    between clients and threads). A forked child makes its own."""
    pid = os.getpid()
    context = _TLS.get(pid)
    if context is None:
        with _TLS_LOCK:
            context = _TLS.get(pid)
            if context is None:
                context = httpx.create_ssl_context()
                _TLS.clear()  # a parent's context stays with the parent
                _TLS[pid] = context
    return context


def key_client_options(secret: str) -> dict[str, Any]:
    """How a key's client is made, sync or async: the key as a bearer token, a 30 s timeout,
    the process's TLS context."""
    return {
        "headers": {"Authorization": f"Bearer {secret}"},
        "timeout": 30.0,
        "verify": tls_context(),
    }


def http_client(secret: str) -> httpx.Client:
    """A sync job's client for a key (``ctx.client()``)."""
    return httpx.Client(**key_client_options(secret))


def _close(client: object) -> None:
    close = getattr(client, "close", None)
    if callable(close):
        close()


@dataclass
class _Slot(Generic[C]):
    idle: list[tuple[float, C]] = field(default_factory=list)  # (returned at, client)
    out: int = 0  # borrowed now


class ClientPool(Generic[C]):
    """At most ``max_per_key`` clients per key (borrowed + idle; None: as many as are borrowed
    at once, for callers bounded by something else, such as the key's lease); idle ones older
    than ``idle_timeout`` are closed; ``healthy(client)`` is asked before a client is reused."""

    def __init__(
        self,
        factory: Callable[[str], C],
        *,
        max_per_key: int | None = 4,
        idle_timeout: float = 60.0,
        healthy: Callable[[C], bool] = lambda client: True,
        close: Callable[[C], None] = _close,
    ) -> None:
        if max_per_key is not None and max_per_key < 1:
            raise ValueError("max_per_key must be at least 1")
        self._factory, self._healthy, self._close = factory, healthy, close
        self.max_per_key, self.idle_timeout = max_per_key, idle_timeout
        self._slots: dict[int, _Slot[C]] = {}
        self._cond = threading.Condition()

    @contextmanager
    def borrow(self, key_id: int, secret: str, *, timeout: float = 30.0) -> Iterator[C]:
        """A client for ``key_id`` for the ``with`` block; waits up to ``timeout`` seconds when
        all of the key's clients are out (TimeoutError then)."""
        client = self._take(key_id, secret, timeout)
        broken = False
        try:
            yield client
        except BaseException:
            broken = True  # a client that raised mid-use is not trusted again
            raise
        finally:
            self._give_back(key_id, client, broken)

    def _take(self, key_id: int, secret: str, timeout: float) -> C:
        deadline = time.monotonic() + timeout
        with self._cond:
            self._prune_locked()
            slot = self._slots.setdefault(key_id, _Slot())
            while True:
                while slot.idle:
                    _, client = slot.idle.pop()
                    if self._healthy(client):
                        slot.out += 1
                        return client
                    self._close(client)
                if self.max_per_key is None or slot.out < self.max_per_key:
                    slot.out += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"all {self.max_per_key} clients of key {key_id} are in use")
                self._cond.wait(left)
        try:
            return self._factory(secret)
        except BaseException:
            with self._cond:
                slot.out -= 1
                self._cond.notify()
            raise

    def _give_back(self, key_id: int, client: C, broken: bool) -> None:
        with self._cond:
            slot = self._slots[key_id]
            slot.out -= 1
            if broken:
                self._close(client)
            else:
                slot.idle.append((time.monotonic(), client))
            self._cond.notify()

    def _prune_locked(self) -> None:
        cutoff = time.monotonic() - self.idle_timeout
        for slot in self._slots.values():
            stale = [c for at, c in slot.idle if at < cutoff]
            slot.idle = [(at, c) for at, c in slot.idle if at >= cutoff]
            for client in stale:
                self._close(client)

    def prune(self) -> None:
        """Close clients idle for longer than ``idle_timeout``."""
        with self._cond:
            self._prune_locked()

    def sizes(self) -> dict[int, tuple[int, int]]:
        """{key id: (borrowed, idle)}."""
        with self._cond:
            return {k: (s.out, len(s.idle)) for k, s in self._slots.items()}

    def close(self) -> None:
        with self._cond:
            for slot in self._slots.values():
                for _, client in slot.idle:
                    self._close(client)
                slot.idle.clear()


CLIENT_IDLE = 300.0  # an HTTP client of a key unused this long is closed


class AsyncClients:
    """One ``httpx.AsyncClient`` per API key on this loop, shared by the jobs holding that key
    (an AsyncClient is safe to share between tasks; its keep-alive pool is the point).
    The key's own lease limits how many calls use it at once."""

    def __init__(self, *, idle: float = CLIENT_IDLE) -> None:
        self.idle = idle
        self._clients: dict[int, tuple[httpx.AsyncClient, float]] = {}

    def get(self, key_id: int, secret: str) -> httpx.AsyncClient:
        found = self._clients.get(key_id)
        client = found[0] if found is not None and not found[0].is_closed else None
        if client is None:
            client = httpx.AsyncClient(
                **key_client_options(secret),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            )
        self._clients[key_id] = (client, time.monotonic())
        return client

    async def prune(self) -> None:
        cutoff = time.monotonic() - self.idle
        for key_id, (client, used) in list(self._clients.items()):
            if used < cutoff:
                del self._clients[key_id]
                await client.aclose()

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        for client, _ in clients.values():
            await client.aclose()
