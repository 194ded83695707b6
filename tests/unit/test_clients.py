"""The per-key client pool: bounded, reused, health-checked, pruned when idle."""

from __future__ import annotations

import threading
import time

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
