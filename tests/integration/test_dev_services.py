"""harvest.dev: the embedded default services (``harvest dev up`` / ``down`` / ``status``).

The private-server tests point ``up``'s probes at closed ports, so that they start their own
servers even though the machine's services answer on 5432 / 6379.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

from harvest import dev
from harvest.dev import host, postgres_server, redis_server
from harvest.errors import ConfigurationError, ServiceUnavailable
from harvest.settings import Settings
from tests.conftest import ADMIN_URL

# The machine's own Postgres, where `harvest dev up` makes its database when one answers on
# 5432 (whatever the test run itself uses: `tests.conftest.ADMIN_URL`).
MACHINE_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _closed_probes() -> dict[str, tuple[str, int]]:
    return {
        "probe_postgres": ("127.0.0.1", _closed_port()),
        "probe_redis": ("127.0.0.1", _closed_port()),
    }


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmdline and _pid_alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _have_system_binaries() -> bool:
    return (
        shutil.which("redis-server") is not None
        and postgres_server._system_postgres_bin() is not None
    )


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / ".harvest"
    yield path
    dev.down(path)  # never leave a server running, even when the test failed


# --- no server started ----------------------------------------------------------------------


def test_env_urls_are_used_as_they_are_and_start_nothing(state_dir: Path) -> None:
    env = {
        dev.DATABASE_ENV: "postgresql+psycopg://app:s3cret@db.invalid:5432/app",
        dev.REDIS_ENV: "redis://:hunter2@cache.invalid:6379/1",
    }
    state = dev.up(state_dir, env=env, **_closed_probes())

    assert state.servers == ()
    assert (state.database_source, state.redis_source) == ("env", "env")
    assert state.database_url == "postgresql+psycopg://app:***@db.invalid:5432/app"
    text = (state_dir / dev.STATE_FILE).read_text()
    assert "s3cret" not in text and "hunter2" not in text
    assert not (state_dir / "postgres").exists() and not (state_dir / "redis").exists()
    assert dev.load_dev_urls(state_dir) is None  # a redacted URL is not handed out
    assert dev.down(state_dir) == []


@pytest.fixture
def machine_services() -> None:
    """Skips a test of the machine's own services on a machine that has none (a fresh one,
    where the suite runs on what `harvest dev up` started)."""
    if not (_port_open(5432) and _port_open(6379)):
        pytest.skip("no Postgres and Redis of the machine's own answer on 5432 / 6379")


@pytest.mark.usefixtures("machine_services")
def test_machine_services_on_the_default_ports_are_used(state_dir: Path) -> None:
    database = f"harvest_dev_{secrets.token_hex(4)}"
    try:
        state = dev.up(state_dir, env={}, database=database)
        assert state.servers == ()
        assert (state.database_source, state.redis_source) == ("default", "default")
        assert state.database_url == f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}"
        assert state.redis_url == "redis://127.0.0.1:6379/0"
        with psycopg.connect(_libpq(state.database_url)) as conn:
            assert conn.execute("SELECT current_database()").fetchone() == (database,)
        assert dev.load_dev_urls(state_dir) == state.urls()
        assert dev.down(state_dir) == []
        assert dev.load_dev_urls(state_dir) is None
    finally:
        with psycopg.connect(MACHINE_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def test_bad_database_name_is_a_configuration_error(state_dir: Path) -> None:
    with pytest.raises(ConfigurationError, match="database name"):
        dev.up(state_dir, env={}, database="x; DROP", **_closed_probes())


def test_status_and_down_without_a_record(state_dir: Path) -> None:
    assert dev.status(state_dir).recorded is False
    assert dev.down(state_dir) == []
    assert dev.load_dev_urls(state_dir) is None


def test_down_forgets_dead_servers_and_never_kills_a_recycled_pid(state_dir: Path) -> None:
    gone = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    common = {"binaries": "system", "executable": "x", "log_file": "x", "run_as": None}
    dead = dev.ServerRecord(
        kind="postgres", pid=int(gone.stdout), port=1, data_dir=str(state_dir / "pg"),
        stop_command=("false",), **common,
    )  # fmt: skip
    recycled = dev.ServerRecord(  # our own pid: alive, but not a redis-server
        kind="redis", pid=os.getpid(), port=1, data_dir=str(state_dir), stop_command=(), **common
    )
    state_dir.mkdir()
    record = dev.DevState(str(state_dir), "", "", "started", "started", (dead, recycled))
    (state_dir / dev.STATE_FILE).write_text(record.to_json())

    status = dev.status(state_dir)
    assert [s.running for s in status.services] == [False, False]
    assert sorted(s.kind for s in dev.down(state_dir)) == ["postgres", "redis"]
    assert not (state_dir / dev.STATE_FILE).exists()
    assert _pid_alive(os.getpid())


# --- private servers ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("binaries", ["system", "bundled"])
def test_private_servers_up_answer_and_down_leaves_nothing(
    state_dir: Path, binaries: dev.Binaries
) -> None:
    if binaries == "system" and not _have_system_binaries():
        pytest.skip("no Postgres/Redis binaries on this machine")
    probes = _closed_probes()
    state = dev.up(state_dir, binaries=binaries, env={}, **probes)

    assert (state.database_source, state.redis_source) == ("started", "started")
    pg, rd = state.server("postgres"), state.server("redis")
    assert pg is not None and rd is not None
    assert {pg.binaries, rd.binaries} == {binaries}
    assert state.database_url == f"postgresql+psycopg://postgres@127.0.0.1:{pg.port}/harvest"
    assert json.loads((state_dir / dev.STATE_FILE).read_text())["servers"][0]["pid"] == pg.pid

    with psycopg.connect(_libpq(state.database_url), autocommit=True) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == ("harvest",)
        conn.execute("CREATE TABLE kept (v text)")
        conn.execute("INSERT INTO kept VALUES ('durable')")
    client = redis.Redis.from_url(state.redis_url)
    try:
        assert client.ping() is True
        assert client.set("k", "v") is True
    finally:
        client.close()

    assert dev.load_dev_urls(state_dir) == state.urls()
    status = dev.status(state_dir)
    assert status.up and all(s.running for s in status.services)
    assert dev.up(state_dir, binaries=binaries, env={}, **probes).servers == state.servers

    stopped = dev.down(state_dir)
    assert sorted(s.kind for s in stopped) == ["postgres", "redis"]
    for server in state.servers:
        assert not _pid_alive(server.pid), server
        assert not _port_open(server.port), server
    assert _processes_mentioning(str(state_dir)) == []
    assert not (state_dir / dev.STATE_FILE).exists()
    assert dev.load_dev_urls(state_dir) is None
    assert dev.down(state_dir) == []

    # the data directory was kept: a second up starts on it again
    again = dev.up(state_dir, binaries=binaries, env={}, **_closed_probes())
    with psycopg.connect(_libpq(again.database_url)) as conn:
        assert conn.execute("SELECT v FROM kept").fetchall() == [("durable",)]
    dev.down(state_dir)
    assert _processes_mentioning(str(state_dir)) == []


@pytest.mark.slow
def test_failed_up_stops_what_it_started(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_server, "_find_redis", lambda binaries: ("system", "/bin/false"))
    with pytest.raises(ServiceUnavailable, match="redis is unavailable: /bin/false"):
        dev.up(state_dir, env={}, **_closed_probes())
    assert _processes_mentioning(str(state_dir)) == []
    assert not (state_dir / dev.STATE_FILE).exists()


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another process listens on (as one that took it after harvest found it
    free would)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def _first_free_port_is(port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each server (Postgres, then Redis) is first given ``port``; every port after that is
    free."""
    given = iter([port, None, port])

    def free_port(host: str = "127.0.0.1") -> int:
        return next(given, None) or _closed_port()

    for module in (host, postgres_server, redis_server):
        monkeypatch.setattr(module, "free_port", free_port, raising=False)


@pytest.mark.slow
def test_a_port_taken_before_the_server_binds_it_is_replaced(
    state_dir: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between finding a port free and the server binding it, another process may take it: the
    server is started on another port, and ``up`` succeeds."""
    if not _have_system_binaries():
        pytest.skip("no Postgres/Redis binaries on this machine")
    _first_free_port_is(taken_port, monkeypatch)

    state = dev.up(state_dir, binaries="system", env={}, **_closed_probes())

    pg, rd = state.server("postgres"), state.server("redis")
    assert pg is not None and rd is not None
    assert taken_port not in (pg.port, rd.port)
    with psycopg.connect(_libpq(state.database_url), autocommit=True) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == ("harvest",)
    client = redis.Redis.from_url(state.redis_url)
    try:
        assert client.ping() is True
    finally:
        client.close()
    for log in (state_dir / "postgres" / "postgres.log", state_dir / "redis" / "redis.log"):
        assert log.read_text().count("Address already in use") == 1, log


@pytest.mark.slow
def test_a_server_that_cannot_bind_says_why(
    state_dir: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server on this machine")
    for module in (host, redis_server):
        monkeypatch.setattr(module, "free_port", lambda host="": taken_port, raising=False)

    with pytest.raises(ServiceUnavailable) as raised:
        redis_server.start_redis(state_dir, "system", 10)

    message = str(raised.value)
    assert message.startswith("redis is unavailable: redis-server exited at start: ")
    assert str(taken_port) in message and "redis.log" in message
    log = (state_dir / "redis" / "redis.log").read_text()
    assert log.count("Address already in use") == host.PORT_TRIES
    assert _processes_mentioning(str(state_dir)) == []


# --- saying what is used, recording only what must be ---------------------------------------


@pytest.mark.usefixtures("machine_services")
def test_machine_services_used_without_recording_them(state_dir: Path) -> None:
    """``record=False`` (the demo): the machine's services are used and named, dev.json is not
    written, so later commands are not silently pointed at them."""
    database = f"harvest_dev_{secrets.token_hex(4)}"
    try:
        state = dev.up(state_dir, env={}, database=database, record=False)
        assert (state.database_source, state.redis_source) == ("default", "default")
        assert not (state_dir / dev.STATE_FILE).exists()
        assert dev.describe(state, "postgres") == "the machine's own server on 127.0.0.1:5432"
        assert dev.describe(state, "redis") == "the machine's own server on 127.0.0.1:6379"
    finally:
        with psycopg.connect(MACHINE_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def test_ensure_and_drop_a_database_on_the_server_of_a_url(migrated: Settings) -> None:
    name = f"harvest_test_{secrets.token_hex(4)}_own"
    url, created = dev.ensure_database(migrated.database_url, name)
    try:
        assert url == migrated.database_url.rsplit("/", 1)[0] + f"/{name}" and created
        assert dev.ensure_database(migrated.database_url, name) == (url, False)
        with pytest.raises(ConfigurationError, match="database name"):
            dev.ensure_database(migrated.database_url, "x; DROP")
    finally:
        assert dev.drop_database(url) == name
    with psycopg.connect(ADMIN_URL) as conn:  # the server this run's tests use
        found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
    assert found is None
