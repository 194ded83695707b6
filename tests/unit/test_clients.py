"""The per-key client pool: bounded, reused, health-checked, pruned when idle."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from harvest.clients import ClientPool


class Client:
    made = 0

    def __init__(self, secret: str) -> None:
        Client.made += 1
        self.secret, self.closed, self.ok = secret, False, True

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def _reset() -> None:
    Client.made = 0


def test_a_returned_client_is_reused_for_the_same_key() -> None:
    pool = ClientPool(Client)
    with pool.borrow(1, "s1") as a:
        pass
    with pool.borrow(1, "s1") as b:
        assert b is a
    with pool.borrow(2, "s2") as c:
        assert c is not a and c.secret == "s2"
    assert Client.made == 2


def test_at_most_max_per_key_are_out_at_once() -> None:
    pool = ClientPool(Client, max_per_key=2)
    with pool.borrow(1, "s"), pool.borrow(1, "s"):
        with pytest.raises(TimeoutError), pool.borrow(1, "s", timeout=0.1):
            pass
        assert pool.sizes()[1] == (2, 0)


def test_without_a_cap_as_many_are_out_as_are_borrowed_and_kept_for_reuse() -> None:
    pool: ClientPool[Client] = ClientPool(Client, max_per_key=None)
    with pool.borrow(1, "s") as a, pool.borrow(1, "s") as b, pool.borrow(1, "s") as c:
        assert len({id(a), id(b), id(c)}) == 3 and pool.sizes()[1] == (3, 0)
    with pool.borrow(1, "s") as again:
        assert again in (a, b, c)
    assert Client.made == 3 and pool.sizes()[1] == (0, 3)


def test_a_waiter_gets_the_client_given_back() -> None:
    pool = ClientPool(Client, max_per_key=1)
    got: list[Client] = []
    with pool.borrow(1, "s") as first:
        waiter = threading.Thread(target=lambda: got.append(pool._take(1, "s", 5)))
        waiter.start()
        time.sleep(0.1)
        assert not got
    waiter.join(5)
    assert got == [first]


def test_an_unhealthy_client_is_closed_not_reused() -> None:
    pool = ClientPool(Client, healthy=lambda c: c.ok)
    with pool.borrow(1, "s") as a:
        a.ok = False
    with pool.borrow(1, "s") as b:
        assert b is not a
    assert a.closed


def test_a_client_that_raised_is_dropped() -> None:
    pool = ClientPool(Client)
    with pytest.raises(RuntimeError), pool.borrow(1, "s") as a:
        raise RuntimeError("connection reset")
    assert a.closed and pool.sizes()[1] == (0, 0)


def test_idle_clients_are_closed_after_the_idle_timeout() -> None:
    pool = ClientPool(Client, idle_timeout=0.05)
    with pool.borrow(1, "s") as a:
        pass
    time.sleep(0.1)
    pool.prune()
    assert a.closed and pool.sizes()[1] == (0, 0)


# --- the keys' HTTP clients: one TLS context a process -------------------------------------


@pytest.fixture
def contexts_made(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """Every TLS context made (httpx makes one with ssl.create_default_context), with its
    arguments; this process's shared one forgotten first."""
    import ssl

    from harvest import clients

    made: list[dict[str, object]] = []
    real = ssl.create_default_context

    def spy(*args: object, **kwargs: object) -> ssl.SSLContext:
        made.append(kwargs)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl, "create_default_context", spy)
    monkeypatch.setattr(clients, "_TLS", {})
    return made


def test_clients_of_many_keys_load_the_ca_bundle_once(
    contexts_made: list[dict[str, object]],
) -> None:
    import asyncio

    from harvest.clients import AsyncClients, http_client

    sync = [http_client(f"sk-{i}") for i in range(20)]
    aclients = AsyncClients()
    async_ = [aclients.get(i, f"sk-{i}") for i in range(20)]
    assert len(contexts_made) == 1  # was one a client: 30-37 ms of CPU each
    assert [c.headers["Authorization"] for c in sync] == [f"Bearer sk-{i}" for i in range(20)]
    assert [c.headers["Authorization"] for c in async_] == [f"Bearer sk-{i}" for i in range(20)]
    for client in sync:
        client.close()
    asyncio.run(aclients.close())


def test_the_shared_context_follows_ssl_cert_file(
    contexts_made: list[dict[str, object]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import certifi

    from harvest.clients import http_client

    bundle = tmp_path / "ca.pem"
    bundle.write_bytes(Path(certifi.where()).read_bytes())
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    http_client("sk-1").close()
    assert contexts_made == [{"cafile": str(bundle)}]


def test_a_forked_child_makes_its_own_context(
    contexts_made: list[dict[str, object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from harvest import clients

    parent = clients.tls_context()
    assert clients.tls_context() is parent
    monkeypatch.setattr(os, "getpid", lambda: -1)  # as in a prefork child
    child = clients.tls_context()
    assert child is not parent and clients.tls_context() is child
    assert len(contexts_made) == 2
