"""A private Postgres for ``harvest dev up``: its binaries (the machine's or pgserver's), the
user it runs as, its data folder and settings, starting it, probing it, and making or dropping
a database on it."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import psycopg
from psycopg import sql

from harvest.dev.host import (
    chown,
    grant_traverse,
    log_ending,
    make_owned_dir,
    on_a_free_port,
    one_line,
    run_command,
    wait_until,
)
from harvest.dev.state import (
    INITDB_TIMEOUT,
    LOOPBACK,
    PROBE_TIMEOUT,
    READY_TIMEOUT,
    Binaries,
    ServerRecord,
)
from harvest.errors import ConfigurationError, ServiceUnavailable
from harvest.redact import redact_text

_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux, 104 on macOS; keep a margin
_DB_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def ensure_database(url: str, database: str, *, timeout: float = PROBE_TIMEOUT) -> tuple[str, bool]:
    """``url`` (a SQLAlchemy URL) pointed at ``database`` on the same server, creating it when
    missing (the URL's role needs CREATEDB then). Returns (the URL, whether it was created)."""
    check_database_name(database)
    base = url.split("?", 1)[0].rsplit("/", 1)[0]
    query = url.split("?", 1)[1] if "?" in url else ""
    target = f"{base}/{database}" + (f"?{query}" if query else "")
    admin = psycopg.conninfo.make_conninfo(_libpq_url(url), dbname="postgres")
    try:
        created = _create_missing(admin, database, timeout)
    except psycopg.Error as exc:
        detail = f"could not create database {database!r}: {one_line(redact_text(str(exc)))}"
        raise ServiceUnavailable("postgres", detail) from exc
    return target, created


def drop_database(url: str, *, timeout: float = PROBE_TIMEOUT) -> str:
    """Drop the database ``url`` names (closing its connections); returns its name."""
    database = url.split("?", 1)[0].rsplit("/", 1)[1]
    check_database_name(database)
    admin = psycopg.conninfo.make_conninfo(_libpq_url(url), dbname="postgres")
    try:
        with _connect(admin, timeout) as conn:
            drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
            conn.execute(drop.format(sql.Identifier(database)))
    except psycopg.Error as exc:
        detail = f"could not drop database {database!r}: {one_line(redact_text(str(exc)))}"
        raise ServiceUnavailable("postgres", detail) from exc
    return database


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
    run_command(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "pgserver"],
        service="postgres",
        what="useradd pgserver",
        timeout=READY_TIMEOUT,
        cwd=Path("/"),
    )
    return "pgserver"


def _as_user(user: str | None, argv: list[str]) -> list[str]:
    return argv if user is None else ["runuser", "-u", user, "--", *argv]


def start_postgres(
    sdir: Path, binaries: Binaries, timeout: float, notes: list[str]
) -> ServerRecord:
    install = _find_postgres(binaries)
    user = _postgres_user()
    root = sdir / "postgres"
    data, run_dir, log = root / "data", root / "run", root / "postgres.log"
    make_owned_dir(root, user)
    make_owned_dir(run_dir, user)
    if user is not None:
        for path in (root, install.bin_dir / "postgres"):
            notes.extend(
                f"chmod {c} so that {user} can reach {path}" for c in grant_traverse(path, user)
            )
    _initdb_if_needed(install, data, user, root)
    pg_ctl = install.exe("pg_ctl")

    def start_on(port: int) -> int:
        _write_pg_conf(data, port, run_dir, user)
        argv = [pg_ctl, "-D", str(data), "-l", str(log), "-w", "-t", f"{timeout:.0f}", "start"]
        try:
            run_command(
                _as_user(user, argv),
                service="postgres",
                what="pg_ctl start",
                timeout=timeout + 5,
                cwd=root,
            )
        except ServiceUnavailable as exc:
            detail = f"{exc.detail} Its log ends: {log_ending(log)}"
            raise ServiceUnavailable("postgres", detail) from exc
        return port

    port = on_a_free_port(start_on, log)
    pid = _postmaster_pid(data)
    wait_until(lambda: pg_admin_problem(port, 2.0), timeout, "postgres", f"{log}")
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
    run_command(
        _as_user(user, argv), service="postgres", what="initdb", timeout=INITDB_TIMEOUT, cwd=cwd
    )


def _check_pg_version(install: _PgInstall, data_version: str, cwd: Path) -> None:
    out = run_command(
        [install.exe("postgres"), "--version"], "postgres", "postgres --version", 10, cwd
    )
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
    chown(conf, user)


def _pg_quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _postmaster_pid(data: Path) -> int:
    try:
        return int((data / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError) as exc:
        raise ServiceUnavailable("postgres", f"no pid in {data / 'postmaster.pid'}: {exc}") from exc


def pg_url(host: str, port: int, database: str) -> str:
    return f"postgresql+psycopg://postgres@{host}:{port}/{database}"


def _libpq_url(url: str) -> str:
    """SQLAlchemy URL -> libpq URL (drop the ``+driver`` part)."""
    return re.sub(r"^postgres(?:ql)?(?:\+[a-z0-9_]+)?://", "postgresql://", url)


def pg_admin_problem(port: int, timeout: float, host: str = LOOPBACK) -> str:
    return postgres_problem(f"postgresql://postgres@{host}:{port}/postgres", timeout)


def postgres_problem(url: str, timeout: float) -> str:
    """'' when ``url`` answers ``SELECT 1``, else a one-line reason."""
    try:
        with _connect(_libpq_url(url), timeout) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return one_line(str(exc)) or type(exc).__name__
    return ""


def create_database(host: str, port: int, database: str, timeout: float) -> None:
    """Create ``database`` on the server at ``host:port`` (as user postgres) when missing."""
    admin = psycopg.conninfo.make_conninfo(host=host, port=port, user="postgres", dbname="postgres")
    try:
        _create_missing(admin, database, timeout)
    except psycopg.Error as exc:
        detail = f"could not create database {database!r} on {host}:{port}: {one_line(str(exc))}"
        raise ServiceUnavailable("postgres", detail) from exc


def _connect(conninfo: str, timeout: float) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(conninfo, autocommit=True, connect_timeout=max(1, round(timeout)))


def _create_missing(admin: str, database: str, timeout: float) -> bool:
    """Create ``database`` through the ``admin`` conninfo unless it exists; True when created.

    Raises psycopg's errors, but for a concurrent creator winning the race (then False).
    """
    try:
        with _connect(admin, timeout) as conn:
            found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
            if found.fetchone() is not None:
                return False
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    except psycopg.errors.DuplicateDatabase:
        return False
    return True


def check_database_name(database: str) -> None:
    if not _DB_NAME.fullmatch(database):
        raise ConfigurationError(
            f"database name {database!r} must be letters, digits and _ (not starting with a digit)"
        )
