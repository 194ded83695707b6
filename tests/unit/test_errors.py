"""One exception tree (harvest/errors.py): every error harvest raises on purpose is a
HarvestError defined there, whatever module raises it."""

from __future__ import annotations

import pytest

from harvest import errors, keystore
from harvest.coordination import lock, semaphore


@pytest.mark.parametrize(
    ("name", "old_home"),
    [("LockNotAcquired", lock), ("SemaphoreBusy", semaphore), ("KeyNotFound", keystore)],
)
def test_coordination_and_key_errors_join_the_one_tree(name: str, old_home: object) -> None:
    error = getattr(errors, name)
    assert issubclass(error, errors.HarvestError)
    assert error.__module__ == "harvest.errors"
    assert getattr(old_home, name) is error  # `from harvest.keystore import KeyNotFound` works


def test_their_messages_name_what_was_not_found_or_held() -> None:
    assert str(errors.KeyNotFound(("ai", "main"))) == "no API key 'main' in pool 'ai'"
    assert str(errors.KeyNotFound(7)) == "no API key with id 7"
    assert "lock 'sync'" in str(errors.LockNotAcquired("sync", 2.0))
    assert isinstance(errors.SemaphoreBusy("s", 1.0), TimeoutError)
