"""Abuse: hostile messages on the queue (S1, S2), hostile payloads at the door (S3), Flower without
credentials (S4), and a planted secret looked for everywhere it could leak (S5). One cluster
(schedule worker, one execution worker, beat, Flower) serves the five cases, in order."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from kombu import Connection

from harvest.broker import EXECUTE_TASK, make_celery
from harvest.errors import EnqueueError
from tests.chaos.conftest import (
    SENTINEL,
    Services,
    World,
    new_world,
    record,
    wait_until,
)

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

FLOWER_AUTH = ("chaos", "flower-" + uuid.uuid4().hex[:12])
# S2 puts these in stray messages: a database URL with a password, and an API key.
STRAY_PASSWORD = "strayPW" + uuid.uuid4().hex[:12]
STRAY_SECRET = f"postgresql://app:{STRAY_PASSWORD}@db.internal/prod"
STRAY_KEY = "sk-stray" + uuid.uuid4().hex


class Abuse:
    def __init__(self, world: World, flower: subprocess.Popen[bytes], flower_url: str) -> None:
        self.world, self.flower, self.flower_url = world, flower, flower_url
        self.worker = next(p for p in world.cluster.procs if "execution" in str(p.args))

    def worker_up(self) -> bool:
        return self.worker.poll() is None

    def still_works(self) -> int:
        """A normal job enqueued now succeeds (the worker still consumes); returns its id."""
        (job,) = self.world.enqueue(1, name="chaos.plain")
        self.world.wait_done([job], 30)
        return job

    def log(self) -> str:
        return self.world.cluster.log(self.worker)

    def cli_many(
        self, calls: list[tuple[list[str], dict[str, str]]]
    ) -> list[subprocess.CompletedProcess[str]]:
        """``harvest ARGS`` for each (args, env) call, run side by side."""
        procs = [
            (
                args,
                subprocess.Popen(
                    [str(Path(sys.executable).parent / "harvest"), *args],
                    env={**self.world.cluster.env, **env},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
            for args, env in calls
        ]
        done = []
        for args, proc in procs:
            out, err = proc.communicate(timeout=90)
            done.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
        return done


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def abuse(services: Services, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Abuse]:
    world = new_world(services, tmp_path_factory.mktemp("abuse"))
    world.standard(execution=1, concurrency=2)
    port = _free_port()
    flower = world.cluster.start(
        "flower",
        [
            "flower",
            "--address=127.0.0.1",
            f"--port={port}",
            f"--basic-auth={FLOWER_AUTH[0]}:{FLOWER_AUTH[1]}",
        ],
    )
    url = f"http://127.0.0.1:{port}"

    def listening() -> bool:
        if flower.poll() is not None:
            raise RuntimeError(f"flower exited:\n{world.cluster.log(flower)[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            return False

    wait_until(listening, 60, 0.2, "flower to listen")
    yield Abuse(world, flower, url)
    world.close()


@pytest.fixture(autouse=True)
def _logs_on_failure(abuse: Abuse, request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        print(abuse.world.cluster.logs(tail=6000))


def _publish_raw(world: World, body: bytes, content_type: str, task: str) -> None:
    with Connection(world.settings.effective_broker_url) as conn:
        conn.Producer().publish(
            body,
            exchange="execution",
            routing_key="execution",
            content_type=content_type,
            content_encoding="binary",
            headers={"task": task, "id": str(uuid.uuid4()), "lang": "py"},
        )


class _Planted:
    """Unpickling this runs ``os.mkdir(path)``: the marker shows whether a worker unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


def test_s1_pickle_message_is_refused(
    abuse: Abuse, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    marker = tmp_path / "unpickled"
    body = pickle.dumps(((_Planted(str(marker)),), {}, {}))
    _publish_raw(abuse.world, body, "application/x-python-serialize", EXECUTE_TASK)
    wait_until(lambda: "ContentDisallowed" in abuse.log(), 30, 0.2, "the worker to refuse it")
    job = abuse.still_works()
    record(
        "S1",
        "raw pickle message on the execution queue",
        request,
        jobs=1,
        lost=0 if abuse.world.succeeded_count([job]) == 1 else 1,
        notes=(
            f"refused (ContentDisallowed, JSON only); unpickled: {marker.exists()}; worker up: "
            f"{abuse.worker_up()}; a job enqueued after it succeeded"
        ),
    )
    assert not marker.exists(), "the worker unpickled a message"
    assert abuse.worker_up()


def test_s2_unknown_task_and_unknown_job_are_dropped(
    abuse: Abuse, request: pytest.FixtureRequest
) -> None:
    world = abuse.world
    celery = make_celery(world.settings)
    before = world.counters()
    try:
        celery.send_task("harvest.no_such_task", args=[STRAY_SECRET, STRAY_KEY], queue="execution")
        celery.send_task(EXECUTE_TASK, args=[[[987_654_321, str(uuid.uuid4())]]], queue="execution")
        celery.send_task(EXECUTE_TASK, args=[{"job": STRAY_SECRET}], queue="execution")
    finally:
        celery.close()

    def counted() -> bool:
        now = world.counters()
        return all(
            now.get(name, 0) > before.get(name, 0)
            for name in ("duplicate_deliveries_suppressed", "malformed_messages_dropped")
        )

    wait_until(lambda: "harvest.no_such_task" in abuse.log() and counted(), 30, 0.2, "drops")
    job = abuse.still_works()
    log = abuse.log()
    lines = [line for line in log.splitlines() if "no_such_task" in line]
    leaked = [s for s in (STRAY_PASSWORD, STRAY_KEY) if s in log]
    record(
        "S2",
        "unknown task, unknown job id, malformed body",
        request,
        jobs=1,
        lost=0 if world.succeeded_count([job]) == 1 else 1,
        notes=(
            f"all three dropped, worker up: {abuse.worker_up()}; the unknown task's log line "
            + ("LEAKS its arguments (a URL password, an API key)" if leaked else "is redacted")
        ),
    )
    assert lines, "no log line names the unknown task"
    assert abuse.worker_up()
    assert not leaked, (
        "the unknown task's log line prints the message body unredacted: " + lines[0][:300]
    )


def _refused(world: World, call: Any, *words: str) -> str:
    before = world.scalar("SELECT count(*) FROM harvest_jobs")
    with pytest.raises(EnqueueError) as info:
        call()
    message = str(info.value)
    assert all(w in message for w in words), message
    assert world.scalar("SELECT count(*) FROM harvest_jobs") == before, "something was stored"
    return message


def test_s3_bad_payloads_refused_at_the_door(abuse: Abuse, request: pytest.FixtureRequest) -> None:
    world = abuse.world
    enqueue = world.client.enqueue
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    api = {
        "malformed": _refused(world, lambda: enqueue("chaos.plain", ["a"]), "JSON object"),
        "unknown field": _refused(world, lambda: enqueue("chaos.plain", {"x": 1}), "does not fit"),
        "missing field": _refused(world, lambda: enqueue("chaos.work", {}), "url"),
        "NaN": _refused(world, lambda: enqueue("chaos.plain", {"low_ms": float("nan")}), "JSON"),
        "10 MB": _refused(
            world, lambda: enqueue("chaos.work", {"url": "x" * 10_000_000}), "over the limit"
        ),
        "nested 100,000 deep": _refused(
            world, lambda: enqueue("chaos.plain", {"low_ms": deep}), "nested deeper than 64"
        ),
    }
    nested = '{"low_ms": ' + "[" * 50_000 + "]" * 50_000 + "}"
    cli_cases = {
        "malformed": ("{not json", {}, "not JSON"),
        "not an object": ("[1, 2]", {}, "JSON object"),
        "unknown field": ('{"x": 1}', {}, "does not fit"),
        "NaN": ('{"low_ms": NaN}', {}, "not valid JSON"),
        "over the size limit": (
            json.dumps({"url": "x" * 100_000}),
            {"HARVEST_MAX_PAYLOAD_BYTES": "65536"},
            "65536",
        ),
        "nested 50,000 deep": (nested, {}, "nested"),
    }
    before = world.scalar("SELECT count(*) FROM harvest_jobs")
    runs = abuse.cli_many(
        [
            (
                [
                    "enqueue",
                    "chaos.work" if "size" in case else "chaos.plain",
                    "--payload",
                    payload,
                ],
                env,
            )
            for case, (payload, env, _) in cli_cases.items()
        ]
    )
    cli: dict[str, str] = {}
    for (case, (_, _, word)), done in zip(cli_cases.items(), runs, strict=True):
        err = done.stderr.strip()
        ok = done.returncode != 0 and len(err.splitlines()) == 1 and word in err
        last = err.splitlines()[-1][:80] if err else ""
        cli[case] = "refused" if ok else f"exit {done.returncode}, not one line: {last}"
    stored = world.scalar("SELECT count(*) FROM harvest_jobs") - before
    typed = world.client.enqueue("chaos.typed", {"n": "abc"}).id
    bad = world.client.enqueue("chaos.bad_input", {"url": "not a url"}).id
    world.wait_done([typed, bad], 30, status="failed")
    ends = {
        r.id: (int(r.attempts), str(r.last_error))
        for r in world.sql(
            "SELECT id, attempts, last_error FROM harvest_jobs WHERE id = ANY(:ids)",
            ids=[typed, bad],
        )
    }
    unclean = {k: v for k, v in cli.items() if v != "refused"}
    record(
        "S3",
        "malformed, schema-violating, 10 MB, deep payloads",
        request,
        jobs=2,
        lost=0,
        duplicate_executions=sum(a - 1 for a, _ in ends.values()),
        notes=(
            f"API: {len(api)} refused with typed errors, nothing stored; CLI: "
            f"{len(cli) - len(unclean)}/{len(cli)} refused on one line"
            + (f" ({'; '.join(f'{k}: {v}' for k, v in unclean.items())})" if unclean else "")
            + "; 10 MB cannot reach the CLI (Linux caps one argument at 128 KiB, and "
            "--payload is the only way in); failing at execution: TypeError and "
            f"PermanentError failed after {sorted(a for a, _ in ends.values())} attempts"
        ),
    )
    assert stored == 0, "the CLI stored a refused payload"
    assert ends[typed][0] == 1 and "TypeError" in ends[typed][1], ends[typed]
    assert ends[bad][0] == 1 and "PermanentError" in ends[bad][1], ends[bad]
    assert not unclean, f"the CLI did not refuse these cleanly: {unclean}"


def test_s4_flower_without_credentials_is_refused(
    abuse: Abuse, request: pytest.FixtureRequest
) -> None:
    codes: dict[str, int] = {}
    with httpx.Client(base_url=abuse.flower_url, timeout=10) as http:
        for path in ("/", "/api/tasks", "/api/workers"):
            codes[f"{path} anonymous"] = http.get(path).status_code
            codes[f"{path} wrong password"] = http.get(
                path, auth=(FLOWER_AUTH[0], "no")
            ).status_code
        codes["/api/tasks with credentials"] = http.get("/api/tasks", auth=FLOWER_AUTH).status_code
        open_paths = {p: http.get(p).status_code for p in ("/metrics", "/healthcheck")}
    refused = [k for k, v in codes.items() if v == 401]
    record(
        "S4",
        "Flower without credentials",
        request,
        notes=(
            f"{len(refused)} of {len(codes) - 1} anonymous or wrong-password requests got 401, "
            f"with credentials {codes['/api/tasks with credentials']}; unauthenticated in Flower "
            f"2.2 (as the README warns): {open_paths}"
        ),
    )
    assert codes.pop("/api/tasks with credentials") == 200
    assert all(v == 401 for v in codes.values()), codes


def _redis_dump(url: str) -> bytes:
    client = redis.Redis.from_url(url)
    chunks: list[bytes] = []
    try:
        for key in client.scan_iter(count=1000):
            chunks.append(key)
            kind = client.type(key)
            if kind == b"string":
                chunks.append(client.get(key) or b"")
            elif kind == b"hash":
                chunks += [k + v for k, v in client.hgetall(key).items()]
            elif kind == b"list":
                chunks += client.lrange(key, 0, -1)
            elif kind == b"set":
                chunks += list(client.smembers(key))
            elif kind == b"zset":
                chunks += client.zrange(key, 0, -1)
            elif kind == b"stream":
                chunks += [repr(e).encode() for e in client.xrange(key)]
    finally:
        client.close()
    return b"\n".join(chunks)


def test_s5_planted_secret_never_leaks(abuse: Abuse, request: pytest.FixtureRequest) -> None:
    world = abuse.world
    ids = world.enqueue(30)
    leaky = world.client.enqueue("chaos.leaky", {}).id
    world.wait_done(ids, 60)
    world.wait_done([leaky], 30, status="failed")
    time.sleep(1.0)  # task events reach Flower
    master = world.services.secret_key
    secrets = {"API key": SENTINEL, "master key": master}
    with httpx.Client(base_url=abuse.flower_url, timeout=10, auth=FLOWER_AUTH) as http:
        flower = http.get("/api/tasks").text + http.get("/api/workers").text
    tables = [
        r[0]
        for r in world.sql(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
            "AND tablename LIKE 'harvest\\_%'"
        )
    ]
    rows = "\n".join(
        str(world.scalar(f"SELECT string_agg(t::text, ' ') FROM {table} t") or "")
        for table in tables
    )
    calls = [
        ["keys", "ls"],
        ["jobs", "ls", "--limit", "200"],
        ["jobs", "show", str(leaky)],
        ["jobs", "show", str(ids[0])],
        ["stats"],
    ]
    cli = "\n".join(d.stdout + d.stderr for d in abuse.cli_many([(c, {}) for c in calls]))
    places = {
        "logs": world.cluster.logs_all(),
        "CLI output": cli,
        "Flower task arguments": flower,
        "Redis keys and values": _redis_dump(world.services.redis_url).decode(errors="replace"),
        "job and key rows": rows,
    }
    leaks = [
        f"{what} in {where}"
        for where, text in places.items()
        for what, s in secrets.items()
        if s in text
    ]
    masked = world.scalar("SELECT last_error FROM harvest_jobs WHERE id = :j", j=leaky)
    record(
        "S5",
        "planted secret looked for everywhere",
        request,
        jobs=len(ids) + 1,
        lost=len(ids) - world.succeeded_count(ids),
        notes=(
            f"key secrets (sentinel) and the master key searched in {', '.join(places)}: "
            f"{'; '.join(leaks) or 'absent'}; a handler that raised with its key stored: "
            f"{str(masked)[:60]!r}; Flower tasks seen: {flower.count('harvest.execute')}"
        ),
    )
    assert not leaks, leaks
    assert "harvest.execute" in flower, (
        "Flower lists no task, so its task arguments could not be searched: with harvest's "
        "celery_config (broker_pool_limit=4) Flower receives no events"
    )
    assert str(leaky) in cli
