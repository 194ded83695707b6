"""Find the processes a test started, by a marker in their environment (children inherit it),
to prove that stopping something left nothing running."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path


def processes_with(marker: str) -> list[str]:
    """``"pid: command line"`` of every live process whose environment contains ``marker``
    (zombies have no environment left, so they do not count)."""
    found = []
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes():
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.append(f"{entry.name}: {cmdline.strip()}")
    return found


def wait_none_left(marker: str, timeout: float = 30.0) -> list[str]:
    """Wait up to ``timeout`` seconds for every marked process to end; returns those left."""
    deadline = time.monotonic() + timeout
    while (left := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return left


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
