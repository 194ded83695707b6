"""What the machine offers :mod:`harvest.dev`: commands run to completion, processes looked up
by pid, free and open ports, folders owned by and reachable for another user, and the one-line
reasons its errors give."""

from __future__ import annotations

import os
import pwd
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from harvest.dev.state import LOOPBACK, POLL
from harvest.errors import ServiceUnavailable
from harvest.redact import redact_text

T = TypeVar("T")

# How many ports a server is tried on when the one just found free was taken before it bound.
PORT_TRIES = 3
_PORT_TAKEN = "Address already in use"
_TAIL = 64 * 1024


def alive(pid: int, *markers: str) -> bool:
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


def run_command(argv: list[str], service: str, what: str, timeout: float, cwd: Path) -> str:
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
        last = one_line(_last_line(output)) or "no output"
        raise ServiceUnavailable(service, f"{what} failed (exit {done.returncode}): {last}")
    return output


def wait_until(problem: Callable[[], str], timeout: float, service: str, log: str) -> None:
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
        time.sleep(POLL * 2)


def make_owned_dir(path: Path, user: str | None) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    chown(path, user)


def chown(path: Path, user: str | None) -> None:
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def grant_traverse(path: Path, user: str) -> list[str]:
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


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def on_a_free_port(start: Callable[[int], T], log: Path) -> T:
    """``start(port)`` on a port that was free a moment ago.

    Between :func:`free_port` closing its socket and the server binding, another process may take
    the port (the server then exits, saying so in its log): ``start`` is called again on another
    port, up to :data:`PORT_TRIES` times. Any other failure is raised at once.
    """
    tries = 0
    while True:
        tries += 1
        seen = log_size(log)
        try:
            return start(free_port())
        except ServiceUnavailable:
            if tries >= PORT_TRIES or _PORT_TAKEN not in log_since(log, seen):
                raise


def log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def log_since(log: Path, offset: int = 0) -> str:
    """What ``log`` gained after ``offset`` bytes ('' when it cannot be read)."""
    try:
        with log.open("rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def log_ending(log: Path) -> str:
    """What a server that stopped said last: the last non-blank line of ``log`` (on one line,
    redacted) and where the log is."""
    said = redact_text(one_line(_last_line(log_since(log, max(0, log_size(log) - _TAIL)))))
    return f"{said or 'nothing in its log'} (log: {log})"


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def has_password(url: str) -> bool:
    try:
        return urlsplit(url).password is not None
    except ValueError:
        return False


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
