"""Start and stop harvest's processes (Celery workers, beat) as subprocesses.

Used by ``harvest demo`` and by the process-level tests. Each process gets its own process
group, so stopping it also stops its prefork children; nothing is left running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class ProcessGroup:
    """``celery -A <app> ...`` processes (harvest's own app by default) sharing one environment
    and one log folder. ``cwd`` and ``repo_on_path=False`` run them as a project outside this
    repository would (the README test)."""

    def __init__(
        self,
        env: Mapping[str, str],
        log_dir: Path,
        *,
        app: str = "harvest.worker",
        cwd: Path = ROOT,
        repo_on_path: bool = True,
    ) -> None:
        self.app = app
        self.cwd = cwd
        self.env = {**os.environ, **env}
        if repo_on_path:
            self.env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(ROOT), self.env.get("PYTHONPATH", "")) if p
            )
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, args: list[str], **env: str) -> subprocess.Popen[bytes]:
        return self.command(name, [sys.executable, "-m", "celery", "-A", self.app, *args], **env)

    def command(self, name: str, argv: list[str], **env: str) -> subprocess.Popen[bytes]:
        """Start ``argv`` as it is (a README line, say), logged to ``<name>-<n>.log``."""
        with (self.log_dir / f"{name}-{len(self.procs)}.log").open("wb") as log:
            proc = subprocess.Popen(
                argv,
                cwd=self.cwd,
                env={**self.env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def worker(
        self, queue: str, concurrency: int = 2, *, pool: str = "prefork", **env: str
    ) -> subprocess.Popen[bytes]:
        """A worker consuming ``queue`` on Celery's ``pool`` (prefork, solo, threads, gevent)."""
        node = f"{queue}-{len(self.procs)}-{os.getpid()}@%h"
        args = [
            "worker",
            "-Q",
            queue,
            "-c",
            str(concurrency),
            "-n",
            node,
            "-l",
            "INFO",
            "--without-gossip",
            "--without-mingle",
            "--pool",
            pool,
        ]
        return self.start(f"worker-{queue}", args, **env)

    def beat(self, **env: str) -> subprocess.Popen[bytes]:
        schedule = self.log_dir / f"beat-{len(self.procs)}-schedule"
        return self.start("beat", ["beat", "-l", "INFO", "-s", str(schedule)], **env)

    def up(self, *, execution: int = 1, concurrency: int = 2) -> None:
        """A schedule worker, ``execution`` execution workers and beat."""
        self.worker("schedule", concurrency=1)
        for _ in range(execution):
            self.worker("execution", concurrency=concurrency)
        self.beat()

    @staticmethod
    def signal(proc: subprocess.Popen[bytes], sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (warm shutdown) to each group, then SIGKILL what is left."""
        for proc in self.procs:
            self.signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.signal(proc, signal.SIGKILL)
                proc.wait(5)
        for proc in self.procs:
            self.signal(proc, signal.SIGKILL)  # any straggler left in the group
        self.procs.clear()

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Block until every worker logged "ready" and beat logged its start (or raise)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            logs = sorted(self.log_dir.glob("*.log"))
            workers = [p for p in logs if p.name.startswith("worker-")]
            beats = [p for p in logs if p.name.startswith("beat-")]
            if all("ready." in p.read_text(errors="replace") for p in workers) and all(
                "Starting..." in p.read_text(errors="replace") for p in beats
            ):
                return
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a harvest process exited while starting:\n{self.logs()}")
            time.sleep(0.2)
        raise TimeoutError(f"harvest processes not ready after {timeout:g}s:\n{self.logs()}")

    def alive(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )
