"""Login throttling: guessing from one address slows to a trickle (state in Redis), while the
right password from another address gets in at once; with Redis down, logins still work."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import httpx
import pytest
from pydantic import SecretStr

from harvest.app import Harvest
from harvest.settings import Settings
from harvest.web import auth, create_app
from harvest.web.throttle import address_bucket
from tests.web.conftest import Server
from tests.web.helpers import forget_logins

USER = "operator"
PASSWORD = "the-right-password"


@pytest.fixture
def url(migrated: Settings, harvest: Harvest) -> Iterator[str]:
    credentials = auth.Credentials(USER, SecretStr(PASSWORD))
    with Server(create_app(migrated, credentials=credentials, harvest=harvest)) as server:
        yield server.url
    forget_logins(migrated.redis_url)


def _from(address: str, url: str) -> httpx.Client:
    """A client whose connections come from ``address`` (any of 127.0.0.0/8 on Linux)."""
    return httpx.Client(
        base_url=url, timeout=10, transport=httpx.HTTPTransport(local_address=address)
    )


def test_guessing_from_one_address_drops_below_ten_a_second(url: str, migrated: Settings) -> None:
    judged, refused = 0, []
    app = create_app(migrated, credentials=auth.Credentials(USER, SecretStr(PASSWORD)))
    with (
        Server(app) as other,
        _from("127.0.0.2", url) as attacker,
        _from("127.0.0.2", other.url) as elsewhere,
    ):
        started = time.monotonic()
        while time.monotonic() - started < 3.0:
            response = attacker.get("/api/csrf", auth=(USER, f"guess-{judged}"))
            if response.status_code == 401:
                judged += 1
            else:
                assert response.status_code == 429
                refused.append(response)
        elapsed = time.monotonic() - started
        assert judged / elapsed < 10, (judged, elapsed)
        assert len(refused) > judged  # most attempts were not judged at all
        assert int(refused[-1].headers["retry-after"]) >= 1
        assert "too many failed logins" in refused[-1].json()["detail"]
        # A right guess while the address is locked does not get in either (first make sure
        # the lock has more than 2 s to run: guess on until a longer one is set).
        while True:
            response = attacker.get("/api/csrf", auth=(USER, "one-more"))
            wait = int(response.headers.get("retry-after", "0"))
            if wait >= 3:
                break
            time.sleep(wait)
        assert attacker.get("/api/csrf", auth=(USER, PASSWORD)).status_code == 429
        # Nor through another server of the same dashboard: the lock is in Redis.
        assert elsewhere.get("/api/csrf", auth=(USER, PASSWORD)).status_code == 429
    # The real user, from another address, gets in at once.
    with _from("127.0.0.3", url) as user:
        assert user.get("/api/csrf", auth=(USER, PASSWORD)).status_code == 200
        assert user.get("/jobs", auth=(USER, PASSWORD)).status_code == 200


def test_a_user_under_attack_is_slowed_only_on_addresses_it_never_used(url: str) -> None:
    with _from("127.0.0.3", url) as home:  # where the operator logs in from
        assert home.get("/api/csrf", auth=(USER, PASSWORD)).status_code == 200
    for n in range(5):  # 20 failures for the user, spread over 5 addresses (4 each: none locked)
        with _from(f"127.0.1.{n + 1}", url) as attacker:
            for i in range(4):
                assert attacker.get("/api/csrf", auth=(USER, f"g{i}")).status_code == 401
    with _from("127.0.2.1", url) as fresh:  # an unknown address: locked at its first failure
        assert fresh.get("/api/csrf", auth=(USER, "typo")).status_code == 401
        assert fresh.get("/api/csrf", auth=(USER, PASSWORD)).status_code == 429
    with _from("127.0.2.2", url) as new:  # the right password from a new address: in at once
        assert new.get("/api/csrf", auth=(USER, PASSWORD)).status_code == 200
    with _from("127.0.0.3", url) as home:  # a known address keeps its free failures
        for _ in range(4):
            assert home.get("/api/csrf", auth=(USER, "typo")).status_code == 401
        assert home.get("/api/csrf", auth=(USER, PASSWORD)).status_code == 200


def test_requests_without_credentials_are_not_counted(url: str) -> None:
    with _from("127.0.0.4", url) as browser:
        for _ in range(20):  # a browser's first request, before it shows the login box
            assert browser.get("/").status_code == 401
            assert browser.get("/", headers={"Authorization": "Basic !!"}).status_code == 401
        assert browser.get("/", auth=(USER, PASSWORD)).status_code == 200


def test_with_redis_down_logins_are_checked_without_throttling(
    migrated: Settings, harvest: Harvest, caplog: pytest.LogCaptureFixture
) -> None:
    down = migrated.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    credentials = auth.Credentials(USER, SecretStr(PASSWORD))
    caplog.set_level(logging.WARNING, logger="harvest.web")
    app = create_app(down, credentials=credentials, harvest=harvest)
    with Server(app) as server, _from("127.0.0.5", server.url) as client:
        for i in range(8):
            assert client.get("/api/csrf", auth=(USER, f"g{i}")).status_code == 401
        assert client.get("/api/csrf", auth=(USER, PASSWORD)).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if "throttling is off" in r.getMessage()]
    assert len(warnings) == 1  # once, not once per attempt


def test_ipv6_addresses_share_a_bucket_per_64() -> None:
    assert address_bucket("2001:db8:1:2:aaaa::1") == address_bucket("2001:db8:1:2:bbbb::9")
    assert address_bucket("2001:db8:1:2::1") != address_bucket("2001:db8:1:3::1")
    assert address_bucket("::ffff:10.0.0.1") == "10.0.0.1"
    assert address_bucket("10.0.0.1") != address_bucket("10.0.0.2")
