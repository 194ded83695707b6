"""What ``harvest dev up`` records and where: the state folder, ``dev.json`` and its lock, and
the names and bounds every part of :mod:`harvest.dev` shares."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from harvest.errors import ConfigurationError

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
POLL = 0.1
_STATE_VERSION = 1


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


def replace_servers(state: DevState, servers: list[ServerRecord]) -> DevState:
    return DevState(
        state.state_dir,
        state.database_url,
        state.redis_url,
        state.database_source,
        state.redis_source,
        tuple(servers),
        state.notes,
    )


@contextlib.contextmanager
def locked(sdir: Path, timeout: float) -> Iterator[None]:
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
                time.sleep(POLL)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def write_state(sdir: Path, state: DevState) -> None:
    tmp = sdir / f".{STATE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(state.to_json(), encoding="utf-8")
    os.replace(tmp, sdir / STATE_FILE)
