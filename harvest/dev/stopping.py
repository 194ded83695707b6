"""Stopping the servers ``harvest dev up`` started: only those, found by pid and command line,
politely first (``pg_ctl stop``, then the server's own shutdown signal) and by SIGKILL last."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from harvest.dev.host import alive, run_command
from harvest.dev.state import KILL_WAIT, LOOPBACK, POLL, ServerRecord
from harvest.errors import HarvestError, ServiceUnavailable


def process_markers(record: ServerRecord) -> tuple[str, ...]:
    """Strings the command line of the recorded server's process contains."""
    if record.kind == "postgres":
        return (record.data_dir,)  # postgres -D <data_dir>
    return ("redis-server", f"{LOOPBACK}:{record.port}")  # its process title


# Postgres: SIGINT is its fast shutdown (SIGTERM would wait for clients), SIGQUIT immediate.
_ESCALATION = {
    "postgres": (signal.SIGINT, signal.SIGQUIT, signal.SIGKILL),
    "redis": (signal.SIGTERM, signal.SIGKILL),
}


def stop_all(
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
    markers = process_markers(record)
    if not alive(record.pid, *markers):
        return
    if record.stop_command:
        with contextlib.suppress(HarvestError):
            run_command(
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
    while alive(pid, *markers):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL)
    return True
