"""Where a scenario runs: services, a fresh database and a Redis db number of its own, and
every process it starts, stopped on the way out whatever happens.

Nothing started here outlives the run: each subprocess gets its own session (process group)
and is registered with the :class:`Reaper`, which stops them all on failure, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import redis

from bench.core import BenchTimeout, Deadline, Row
from harvest.procs import ProcessGroup
from harvest.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS_BASE = "redis://127.0.0.1:6379"
OWNER_KEY = "harvest:test:owner"  # the marker tests/conftest.py uses: tests and benchmarks share
OWNER_TTL = 4 * 3600


# --- services ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Services:
    admin_url: str  # libpq URL of the admin database ("postgres")
    redis_base: str  # Redis URL without a db number
    started_here: bool = False


def _answers(admin_url: str, redis_base: str) -> bool:
    try:
        with psycopg.connect(admin_url, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
        client = redis.Redis.from_url(f"{redis_base}/0", socket_connect_timeout=3)
        try:
            client.ping()
        finally:
            client.close()
    except (psycopg.Error, redis.RedisError, OSError):
        return False
    return True


@contextlib.contextmanager
def services(admin_url: str, redis_base: str) -> Iterator[Services]:
    """The given Postgres and Redis when they answer; else harvest's embedded default
    (``harvest.dev.up``: the machine's binaries or the ``embedded`` extra), stopped after."""
    if _answers(admin_url, redis_base):
        yield Services(admin_url, redis_base)
        return
    from harvest import dev

    before = dev.read_state()
    state = dev.up()
    started = bool(state.servers) and not (before and before.servers)
    try:
        server = state.database_url.split("://", 1)[1].rsplit("/", 1)[0]
        yield Services(
            f"postgresql://{server}/postgres", state.redis_url.rsplit("/", 1)[0], started
        )
    finally:
        if started:
            dev.down()


# --- processes --------------------------------------------------------------------------------


class Reaper:
    """Every process the run started, to be stopped on the way out (idempotent)."""

    def __init__(self) -> None:
        self._stops: dict[int, Callable[[], None]] = {}
        self._next = 0

    def register(self, stop: Callable[[], None]) -> int:
        self._next += 1
        self._stops[self._next] = stop
        return self._next

    def release(self, token: int) -> None:
        stop = self._stops.pop(token, None)
        if stop is not None:
            stop()

    def stop_all(self) -> None:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C waits
        try:
            for token in sorted(self._stops, reverse=True):
                with contextlib.suppress(Exception):
                    self.release(token)
        finally:
            signal.signal(signal.SIGINT, previous)


def stop_popen(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM to the process's group, SIGKILL after ``timeout``, then SIGKILL stragglers."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def stop_mp(proc: mp.process.BaseProcess, timeout: float = 5.0) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


# --- one scenario's private world -------------------------------------------------------------


@dataclass(frozen=True)
class Database:
    name: str
    url: str  # libpq form, for psycopg
    sa_url: str  # SQLAlchemy form, for harvest


@dataclass
class Ctx:
    """A scenario's context: its config, its private databases and Redis db numbers, its
    processes, and its progress bar. Everything it made is removed by :meth:`close` (and what
    a :meth:`scope` made, when the scope ends)."""

    name: str
    cfg: Any  # bench.cli.Config
    services: Services
    reaper: Reaper
    log_dir: Path
    progress: Callable[[str, float, float | None], None] = lambda desc, adv, total: None
    redis_db: int = 0
    _cleanups: list[Callable[[], None]] = field(default_factory=list)
    _stoppers: set[int] = field(default_factory=set)  # ids of cleanups that stop processes
    rows: list[Row] = field(default_factory=list)  # what was measured, kept if it fails later

    # --- lifecycle ------------------------------------------------------------------------

    def open(self) -> Ctx:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis_db = self.new_redis_db()
        return self

    def close(self) -> None:
        self._unwind(0)

    def _unwind(self, mark: int) -> None:
        """Stop the processes first, all at once (each may take seconds to shut down warmly),
        then undo the rest, last in first out."""
        stops = [c for c in self._cleanups[mark:] if id(c) in self._stoppers]
        if stops:
            with ThreadPoolExecutor(max_workers=len(stops)) as pool:
                for future in [pool.submit(stop) for stop in stops]:
                    with contextlib.suppress(Exception):
                        future.result()
        while len(self._cleanups) > mark:
            cleanup = self._cleanups.pop()
            if id(cleanup) in self._stoppers:
                self._stoppers.discard(id(cleanup))
                continue
            with contextlib.suppress(Exception):
                cleanup()

    def _stop_later(self, token: int) -> None:
        def stop() -> None:
            self.reaper.release(token)

        self._stoppers.add(id(stop))
        self._cleanups.append(stop)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Undo, on leaving, whatever was set up inside (processes, databases, clients)."""
        mark = len(self._cleanups)
        try:
            yield
        finally:
            self._unwind(mark)

    def record(self, *rows: Row) -> None:
        """Rows this scenario measures into (recorded up front: a failure keeps what was
        measured before it)."""
        self.rows.extend(r for r in rows if all(r is not x for x in self.rows))

    def later(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` when the scenario (or the current scope) ends; last in, first out."""
        self._cleanups.append(cleanup)

    def plan(self, total: float) -> None:
        """How many progress units this scenario will report in all."""
        self.progress("", 0.0, total)

    def step(self, desc: str, advance: float = 0.0) -> None:
        self.progress(desc, advance, None)

    # --- Redis ----------------------------------------------------------------------------

    def new_redis_db(self) -> int:
        """One more Redis db number of this scenario's own (flushed and released at the end)."""
        db = claim_redis_db(self.services.redis_base)
        self.later(lambda: release_redis_db(self.services.redis_base, db))
        return db

    def redis_url_of(self, db: int) -> str:
        return f"{self.services.redis_base}/{db}"

    @property
    def redis_url(self) -> str:
        return self.redis_url_of(self.redis_db)

    def redis(self, url: str | None = None) -> redis.Redis:
        client = redis.Redis.from_url(url or self.redis_url, socket_timeout=10)
        self.later(client.close)
        return client

    # --- Postgres -------------------------------------------------------------------------

    def database(self, tag: str = "") -> Database:
        """A new empty database, dropped (with force) when the scenario or scope ends."""
        name = f"harvest_bench_{self.name}{'_' + tag if tag else ''}_{secrets.token_hex(3)}"
        name = name.replace("-", "_").lower()
        admin = self.services.admin_url
        with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self.later(lambda: drop_database(admin, name))
        server = admin.split("://", 1)[1].rsplit("/", 1)[0]
        return Database(
            name, f"postgresql://{server}/{name}", f"postgresql+psycopg://{server}/{name}"
        )

    def settings(self, db: Database, redis_url: str | None = None, **overrides: Any) -> Settings:
        return Settings(database_url=db.sa_url, redis_url=redis_url or self.redis_url, **overrides)

    def migrated(self, db: Database, redis_url: str | None = None, **overrides: Any) -> Settings:
        from harvest.migrate import upgrade

        settings = self.settings(db, redis_url, **overrides)
        upgrade(settings, "head")
        return settings

    # --- processes ------------------------------------------------------------------------

    def harvest_workers(
        self,
        settings: Settings,
        knobs: Mapping[str, str] | None = None,
        *,
        tag: str = "harvest",
        imports: str = "bench.jobs",
        concurrency: int = 2,
        ready_timeout: float = 90.0,
    ) -> ProcessGroup:
        """harvest's worker set (schedule worker, one execution worker with ``concurrency``
        processes, beat), through ``harvest.procs.ProcessGroup``, configured as a user would
        (``HARVEST_*`` variables), and ready."""
        env = {
            "HARVEST_DATABASE_URL": settings.database_url,
            "HARVEST_REDIS_URL": settings.redis_url,
            "HARVEST_IMPORTS": imports,
            **(knobs or {}),
        }
        group = ProcessGroup(env, self.log_dir / f"{tag}-{secrets.token_hex(2)}")
        self._stop_later(self.reaper.register(group.stop))
        group.up(execution=1, concurrency=concurrency)
        group.wait_ready(ready_timeout)
        return group

    def harvest_workers_with(
        self,
        env: Mapping[str, str],
        execution: Sequence[str],
        *,
        tag: str = "harvest",
        ready_timeout: float = 90.0,
    ) -> ProcessGroup:
        """harvest's worker set with the execution worker's pool options given
        (``["--pool", "threads", "-c", "64"]``): a schedule worker, that execution worker and
        beat, in the environment ``env`` (``HARVEST_*`` as a user sets them), and ready."""
        group = ProcessGroup(env, self.log_dir / f"{tag}-{secrets.token_hex(2)}")
        self._stop_later(self.reaper.register(group.stop))
        group.worker("schedule", concurrency=1)
        node = f"execution-{tag}-{secrets.token_hex(2)}@%h"
        args = ["worker", "-Q", "execution", "-n", node, "-l", "INFO", "--without-gossip",
                "--without-mingle", *execution]  # fmt: skip
        group.start("worker-execution", args)
        group.beat()
        group.wait_ready(ready_timeout)
        return group

    def spawn(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """A subprocess in its own session, logged to ``<log_dir>/<name>.log``, stopped when
        the scenario (or scope) ends."""
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), full_env.get("PYTHONPATH", "")) if p
        )
        with (self.log_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                list(argv),
                cwd=ROOT,
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._stop_later(self.reaper.register(lambda: stop_popen(proc)))
        return proc

    def log_text(self, name: str, tail: int = 3000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    def parallel(
        self,
        target: Callable[..., Any],
        args: Sequence[tuple[Any, ...]],
        *,
        timeout: float,
    ) -> list[Any]:
        """Run ``target(ready, *a)`` in one spawned process per item of ``args``, at once.

        Each child sets up (connects, prepares), then calls ``ready()``, which returns when
        every child is ready; it then does its measured work and returns a picklable result.
        The results come back in the order of ``args``. Bounded by ``timeout`` in all; the
        children are stopped whatever happens."""
        spawn = mp.get_context("spawn")
        go = spawn.Event()
        queue: Any = spawn.Queue()
        procs = [
            spawn.Process(target=_child, args=(target, i, queue, go, a), daemon=True)
            for i, a in enumerate(args)
        ]
        tokens = []
        try:
            for proc in procs:
                proc.start()
                tokens.append(self.reaper.register(lambda p=proc: stop_mp(p)))
            return _collect(procs, queue, go, timeout)
        finally:
            go.set()
            for token in tokens:
                self.reaper.release(token)
            queue.close()


def _collect(procs: list[Any], queue: Any, go: Any, timeout: float) -> list[Any]:
    deadline = Deadline(timeout)
    ready = 0
    results: dict[int, Any] = {}
    while len(results) < len(procs):
        if deadline.passed():
            raise BenchTimeout(f"benchmark child processes did not finish within {timeout:g}s")
        try:
            index, kind, value = queue.get(timeout=min(1.0, max(0.05, deadline.left())))
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a benchmark child process died") from None
            continue
        if kind == "ready":
            ready += 1
            if ready == len(procs):
                go.set()
        elif kind == "error":
            raise RuntimeError(f"benchmark child {index} failed: {value}")
        else:
            results[index] = value
    return [results[i] for i in range(len(procs))]


def _child(
    target: Callable[..., Any], index: int, queue: Any, go: Any, args: tuple[Any, ...]
) -> None:
    def ready() -> None:
        queue.put((index, "ready", None))
        if not go.wait(120):
            raise BenchTimeout("never told to go")

    try:
        queue.put((index, "result", target(ready, *args)))
    except BaseException as exc:
        queue.put((index, "error", f"{type(exc).__name__}: {exc}"))


# --- databases and Redis db numbers -----------------------------------------------------------


def drop_database(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def claim_redis_db(redis_base: str, *, wait: float = 120.0) -> int:
    """A free Redis db number 1-15, claimed with the same ``SET NX`` marker the tests use."""
    deadline = Deadline(wait)
    while True:
        for db in range(1, 16):
            client = redis.Redis.from_url(f"{redis_base}/{db}", socket_timeout=10)
            try:
                if client.set(OWNER_KEY, f"bench:{os.getpid()}", nx=True, ex=OWNER_TTL):
                    client.flushdb()
                    client.set(OWNER_KEY, f"bench:{os.getpid()}", ex=OWNER_TTL)
                    return db
            finally:
                client.close()
        if deadline.passed():
            raise BenchTimeout("no free Redis db number (1-15): tests or benchmarks hold them all")
        time.sleep(1.0)


def release_redis_db(redis_base: str, db: int) -> None:
    client = redis.Redis.from_url(f"{redis_base}/{db}", socket_timeout=10)
    try:
        client.flushdb()
    finally:
        client.close()


def python_m(module: str) -> list[str]:
    return [sys.executable, "-m", module]
