"""A private PgBouncer (Debian's package) in transaction mode, in front of the test Postgres.

Started by the tests like the other services: its own config and log in a temporary folder, a
free port, trust auth, ``pool_mode = transaction`` and a pool of ``POOL_SIZE`` server
connections, far fewer than the harvest processes that go through it. Never the system
service. PgBouncer refuses to run as root: as root it runs as the ``postgres`` user (or
``nobody``).
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

POOL_SIZE = 10

# What a transaction-mode pooler breaks, as Postgres, psycopg and PgBouncer word it.
BROKEN = re.compile(
    r"prepared statement \S+ (?:does not exist|already exists)"
    r"|advisory lock"
    r"|unsupported startup parameter"
    r"|startup parameter",
    re.IGNORECASE,
)


def pooler_errors(*paths: Path) -> list[str]:
    """Every line of ``paths`` that says a pooler broke something (see ``BROKEN``)."""
    return [
        f"{path.name}: {line.strip()}"
        for path in paths
        for line in path.read_text(errors="replace").splitlines()
        if BROKEN.search(line)
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _unprivileged_user() -> pwd.struct_passwd:
    """The ``postgres`` user (Debian's Postgres packages make it), else ``nobody``."""
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        return pwd.getpwnam("nobody")


class PgBouncer:
    """``pgbouncer`` on 127.0.0.1:``port``, forwarding every database to ``host:port``."""

    def __init__(self, server_host: str, server_port: int) -> None:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not os.path.exists(binary):
            raise RuntimeError("pgbouncer is not installed (apt-get install -y pgbouncer)")
        self.dir = Path(tempfile.mkdtemp(prefix="harvest-pgbouncer-"))
        self.port = _free_port()
        self.log = self.dir / "pgbouncer.log"
        self.dir.joinpath("users.txt").write_text('"postgres" ""\n')
        self.dir.joinpath("pgbouncer.ini").write_text(
            "[databases]\n"
            f"* = host={server_host} port={server_port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {self.dir / 'users.txt'}\n"
            "admin_users = postgres\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {POOL_SIZE}\n"
            f"max_db_connections = {POOL_SIZE}\n"
            "reserve_pool_size = 0\n"
            "max_client_conn = 900\n"
            f"logfile = {self.log}\n"
            "log_connections = 0\n"
            "log_disconnections = 0\n"
        )
        argv = [binary, str(self.dir / "pgbouncer.ini")]
        if os.geteuid() == 0:  # PgBouncer will not run as root
            owner = _unprivileged_user()
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, owner.pw_uid, owner.pw_gid)
            argv = ["runuser", "-u", owner.pw_name, "--", *argv]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._wait_ready()

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` through this PgBouncer."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited at start:\n{self.log_text()}")
            try:
                with psycopg.connect(
                    host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                    connect_timeout=2, prepare_threshold=None,
                ) as conn:  # fmt: skip
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"pgbouncer not ready after {timeout:g}s:\n{self.log_text()}")

    def clients(self) -> int:
        """How many client connections PgBouncer holds now (its admin console, SHOW CLIENTS)."""
        out = subprocess.run(
            ["psql", "-X", "-w", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
             "-d", "pgbouncer", "-tAc", "SHOW CLIENTS"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout  # fmt: skip
        return len([line for line in out.splitlines() if line.strip()])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else "(no log)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)
