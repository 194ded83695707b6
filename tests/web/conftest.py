"""The dashboard served for real: uvicorn on a free loopback port, in a thread of the test
process, against this run's private database and Redis db; a headless Chromium driven by
Playwright (Debian's /usr/bin/chromium; the browser tests are skipped without it)."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.fernet import Fernet
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from harvest import keystore
from harvest.app import Harvest
from harvest.procs import ProcessGroup
from harvest.settings import Settings
from harvest.web import auth, create_app, serve

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts" / "web"
USER = "operator"
FAST = {
    "HARVEST_LEASE_TTL": "3",
    "HARVEST_DISPATCH_TTL": "10",
    "HARVEST_RESCUE_INTERVAL": "1",
    "HARVEST_DISPATCH_INTERVAL": "0.5",
    "HARVEST_IMPORTS": "tests.web.jobs",
}


class Server:
    """One uvicorn server in a thread, on a socket bound before it starts (no port race), with
    the bounds of ``harvest web`` (harvest.web.serve; ``bounds`` overrides them)."""

    def __init__(self, app: Any, **bounds: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = serve.config(app, log_level="warning", lifespan="on", access_log=False, **bounds)
        self.server = serve.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the web server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


@dataclass(frozen=True)
class Web:
    url: str
    user: str
    password: str

    @property
    def auth(self) -> tuple[str, str]:
        return (self.user, self.password)

    def client(self, **kwargs: Any) -> httpx.Client:
        """An authenticated client (keeps the CSRF cookie like a browser)."""
        return httpx.Client(base_url=self.url, auth=self.auth, timeout=30, **kwargs)


@pytest.fixture(scope="session")
def web_password() -> str:
    return secrets.token_urlsafe(18)


@pytest.fixture(scope="session")
def web(migrated: Settings, web_password: str) -> Iterator[Web]:
    """The dashboard with credentials, for the whole run."""
    from pydantic import SecretStr

    credentials = auth.Credentials(USER, SecretStr(web_password))
    with Server(create_app(migrated, credentials=credentials)) as server:
        yield Web(server.url, USER, web_password)


@pytest.fixture
def http(web: Web) -> Iterator[httpx.Client]:
    with web.client() as client:
        yield client


def csrf_token(client: httpx.Client) -> str:
    """A CSRF token for ``client`` (its cookie lands in the client's jar)."""
    response = client.get("/api/csrf")
    response.raise_for_status()
    token: str = response.json()["token"]
    return token


@pytest.fixture
def harvest(migrated: Settings, clean_db: Engine, redis_client: object) -> Iterator[Harvest]:
    """The enqueuing side, with the web test jobs, on an empty database and Redis db."""
    app = Harvest(migrated)
    app.load_imports(["tests.web.jobs"])
    yield app
    app.close()


@pytest.fixture
def cipher() -> keystore.Cipher:
    return keystore.Cipher(Fernet(Fernet.generate_key()))


def add_keys(
    harvest: Harvest, cipher: keystore.Cipher, pool: str, secrets_by_name: dict[str, str]
) -> dict[str, keystore.KeyInfo]:
    """Keys in Postgres (encrypted), then the pool synced into Redis."""
    added = {}
    with Session(harvest.engine) as session, session.begin():
        for name, secret in secrets_by_name.items():
            info, _ = keystore.add_key(
                session, cipher, pool=pool, name=name, secret=secret, max_concurrency=2
            )
            added[name] = info
    keystore.sync_pool(harvest.engine, harvest.redis, pool)
    return added


@pytest.fixture
def workers(migrated: Settings, tmp_path: Path) -> Iterator[ProcessGroup]:
    """Real Celery processes (schedule worker, execution worker, beat) running the web test
    jobs; started by the test with ``up()``, stopped after it."""
    env = {
        **FAST,
        "HARVEST_DATABASE_URL": migrated.database_url,
        "HARVEST_REDIS_URL": migrated.redis_url,
    }
    group = ProcessGroup(env, tmp_path / "logs")
    yield group
    group.stop()


# --- the browser ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(
            "no /usr/bin/chromium: install Debian's chromium (apt-get install -y chromium) "
            "to run the browser tests"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any, web: Web) -> Iterator[Any]:
    """A fresh browser context (its own profile: cookies, cache) logged in with Basic auth."""
    context = browser.new_context(
        base_url=web.url,
        http_credentials={"username": web.user, "password": web.password},
        viewport={"width": 1280, "height": 900},
    )
    context.set_default_timeout(15_000)
    tab = context.new_page()
    yield tab
    context.close()


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
