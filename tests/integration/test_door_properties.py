"""Property tests at the door (issue 13): for every public enqueue parameter, any value is either
refused with a typed error (EnqueueError, naming what is wrong) and nothing is stored, or stored
and read back equal, through the Python API (store.get, as app.get reads) and the JSON API's
serializer (what /api/jobs/{id} returns).

Every example runs in one transaction on one connection (enqueue's ``connection=``), rolled
back after it: no commit, no nudge, a few milliseconds each. Examples are derandomized (CI is
stable) and fixed in number per parameter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine, text

from harvest import store
from harvest.app import Harvest
from harvest.errors import EnqueueError, InvalidOption, InvalidPayload, UnknownJob
from harvest.jobs import Job
from harvest.settings import Settings
from harvest.validation import MAX_DEPTH, RUN_AT_MAX, RUN_AT_MIN
from harvest.web.models import JobDetailOut

EXAMPLES = 500
LIMIT = 4096  # max_payload_bytes here, so that sizes around it are cheap to reach
PROPERTY = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.function_scoped_fixture,
    ],
)


@pytest.fixture(scope="module")
def door(migrated: Settings, engine: Engine) -> Iterator[tuple[Harvest, Connection]]:
    app = Harvest(migrated.model_copy(update={"max_payload_bytes": LIMIT}))

    @app.job("anything")
    def anything(ctx: object, **payload: Any) -> None:
        return None

    with engine.connect() as conn:
        conn.execute(text("DELETE FROM harvest_jobs"))
        conn.commit()
        yield app, conn
    app.close()


def attempt(
    door: tuple[Harvest, Connection], enqueue: Callable[[Harvest, Connection], int]
) -> tuple[Job | None, EnqueueError | None]:
    """Enqueue in a transaction rolled back after: the job read back, or the refusal (and then
    nothing stored)."""
    app, conn = door
    conn.begin()
    try:
        try:
            job_id = enqueue(app, conn)
        except EnqueueError as exc:
            stored = conn.execute(text("SELECT count(*) FROM harvest_jobs")).scalar_one()
            assert stored == 0, "refused, yet a row was stored"
            return None, exc
        job = store.get(conn, job_id)
        assert job is not None and job.unreadable == ()
        return job, None
    finally:
        conn.rollback()


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same JSON type all the way down (True is not 1, 1.0 is not 1)."""
    if isinstance(a, tuple | list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def api_payload(job: Job) -> Any:
    """The payload as the JSON API sends it, parsed by a client."""
    return json.loads(JobDetailOut.of(job).model_dump_json())["payload"]


# --- payload ----------------------------------------------------------------------------------

every_char = st.characters(exclude_categories=())  # NUL and lone surrogates included
texts = st.one_of(
    st.text(every_char, max_size=12),
    st.text(st.characters(max_codepoint=127), min_size=LIMIT - 40, max_size=LIMIT + 8),
)
# Integers built from their digit count: Hypothesis cannot repr a strategy bound or a sampled
# value beyond Python's 4300-digit limit.
huge = st.builds(
    lambda digits, sign, low: sign * (10 ** (digits - 1) + low),
    st.integers(4290, 4310),
    st.sampled_from([1, -1]),
    st.integers(0, 10**6),
)
numbers = st.one_of(
    st.integers(),
    huge,
    st.sampled_from([2**63, -(2**63) - 1, 2**64]),
    st.floats(),  # nan, +-inf, subnormals, -0.0, 1e308
    st.floats(min_value=1e15, max_value=1e17),  # where Python writes an exponent
)
leaves = st.one_of(st.none(), st.booleans(), numbers, texts)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(every_char, max_size=6), inner, max_size=4),
    ),
    max_leaves=12,
)


def nested(depth: int) -> dict[str, Any]:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return {"a": value}


payloads = st.one_of(
    st.dictionaries(st.text(every_char, max_size=8), values, max_size=5),
    st.integers(MAX_DEPTH - 3, MAX_DEPTH + 3).map(nested),
    values,  # mostly not an object: refused
)


@PROPERTY
@given(payload=payloads)
def test_payloads(door: tuple[Harvest, Connection], payload: Any) -> None:
    job, refused = attempt(door, lambda app, c: app.enqueue("anything", payload, connection=c).id)
    if refused is not None:
        assert isinstance(refused, InvalidPayload), refused
        return
    assert job is not None
    expected = {} if payload is None else payload  # None: no arguments (the default)
    assert same(expected, job.payload), (payload, job.payload)
    assert same(expected, api_payload(job))


def test_the_payload_examples_reach_both_outcomes(door: tuple[Harvest, Connection]) -> None:
    """The strategies above are not vacuous: each kind of trouble is refused, by type."""
    cases = {
        "huge int": {"a": 10**5000},
        "nan": {"a": math.nan},
        "NUL": {"a": "x\x00"},
        "surrogate value": {"a": "\udcff"},
        "surrogate key": {"\ud800": 1},
        "too deep": nested(MAX_DEPTH + 1),
        "too large": {"a": "x" * LIMIT},
    }
    for what, payload in cases.items():
        job, refused = attempt(
            door, lambda app, c, p=payload: app.enqueue("anything", p, connection=c).id
        )
        assert isinstance(refused, InvalidPayload) and job is None, what
    job, _ = attempt(door, lambda app, c: app.enqueue("anything", {"f": 1e23}, connection=c).id)
    assert job is not None and same({"f": 1e23}, job.payload)  # a float stays a float


# --- run_at, delay ----------------------------------------------------------------------------

offsets = st.timedeltas(
    min_value=-timedelta(hours=23, minutes=59, seconds=59),
    max_value=timedelta(hours=23, minutes=59, seconds=59),
).map(timezone)
run_ats = st.one_of(
    st.datetimes(timezones=st.one_of(offsets, st.timezones())),
    st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(1, 1, 3), timezones=offsets),
    st.datetimes(min_value=datetime(9999, 12, 29), timezones=offsets),
    st.datetimes(),  # naive: refused
)


@PROPERTY
@given(run_at=run_ats)
def test_run_at(door: tuple[Harvest, Connection], run_at: datetime) -> None:
    job, refused = attempt(
        door, lambda app, c: app.enqueue("anything", run_at=run_at, connection=c).id
    )
    if refused is not None:
        assert isinstance(refused, InvalidOption) and refused.option == "run_at", refused
        assert run_at.utcoffset() is None or not RUN_AT_MIN <= run_at <= RUN_AT_MAX
        return
    # the same instant: compared in UTC, since Python never calls a time in a repeated hour
    # (fold) equal to one in another zone
    instant = run_at.astimezone(UTC)
    assert job is not None and job.run_at == instant
    assert JobDetailOut.of(job).run_at == instant


delays = st.one_of(
    st.floats(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.timedeltas(),
    st.sampled_from([5e-324, 315360000.0, 315360000.000001]),
    huge,
)


@PROPERTY
@given(delay=delays)
def test_delay(door: tuple[Harvest, Connection], delay: Any) -> None:
    job, refused = attempt(
        door, lambda app, c: app.enqueue("anything", delay=delay, connection=c).id
    )
    if refused is not None:
        assert isinstance(refused, InvalidOption) and refused.option == "delay", refused
        return
    assert job is not None and job.run_at is not None and job.created_at is not None
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
    assert abs((job.run_at - job.created_at).total_seconds() - seconds) <= 1e-6


# --- the integer options, the idempotency key, the name, wait -------------------------------

integers_and_more = st.one_of(
    st.integers(),
    huge,
    st.integers(-1002, 1002),
    st.booleans(),
    st.floats(),
    st.text(max_size=3),
    st.none(),
)


@PROPERTY
@given(priority=integers_and_more)
def test_priority(door: tuple[Harvest, Connection], priority: Any) -> None:
    job, refused = attempt(
        door, lambda app, c: app.enqueue("anything", priority=priority, connection=c).id
    )
    if refused is not None:
        assert isinstance(refused, InvalidOption) and refused.option == "priority", refused
        return
    assert job is not None and same(priority, job.priority)


@PROPERTY
@given(max_attempts=integers_and_more)
def test_max_attempts(door: tuple[Harvest, Connection], max_attempts: Any) -> None:
    job, refused = attempt(
        door,
        lambda app, c: app.enqueue("anything", max_attempts=max_attempts, connection=c).id,
    )
    if refused is not None:
        assert isinstance(refused, InvalidOption) and refused.option == "max_attempts", refused
        return
    assert job is not None
    assert job.max_attempts == (3 if max_attempts is None else max_attempts)


keys = st.one_of(
    st.text(every_char, max_size=12),
    st.text(st.characters(max_codepoint=0x10FFFF), min_size=250, max_size=260),
    st.integers(),
    st.none(),
)


@PROPERTY
@given(key=keys)
def test_idempotency_key(door: tuple[Harvest, Connection], key: Any) -> None:
    def twice(app: Harvest, c: Connection) -> int:
        first = app.enqueue("anything", idempotency_key=key, connection=c)
        again = app.enqueue("anything", idempotency_key=key, connection=c)
        assert (again.id == first.id and not again.created) == (key is not None)
        return first.id

    job, refused = attempt(door, twice)
    if refused is not None:
        assert isinstance(refused, InvalidOption) and refused.option == "idempotency_key"
        return
    assert job is not None and job.idempotency_key == key


tenants = st.one_of(
    st.text(every_char, max_size=12),
    st.text(st.characters(max_codepoint=0x10FFFF), min_size=195, max_size=205),
    st.integers(),
    st.none(),
)


@PROPERTY
@given(tenant=tenants)
def test_tenant(door: tuple[Harvest, Connection], tenant: Any) -> None:
    job, refused = attempt(
        door, lambda app, c: app.enqueue("anything", tenant=tenant, connection=c).id
    )
    if refused is not None:
        assert isinstance(refused, InvalidOption) and refused.option == "tenant", refused
        return
    assert job is not None and job.tenant == tenant


@PROPERTY
@given(name=st.text(every_char, max_size=20), wait=st.one_of(st.none(), st.floats(), st.integers()))
def test_name_and_wait(door: tuple[Harvest, Connection], name: str, wait: Any) -> None:
    job, refused = attempt(door, lambda app, c: app.enqueue(name, wait=wait, connection=c).id)
    if refused is not None:
        assert isinstance(refused, UnknownJob | InvalidOption), refused
        str(refused).encode("utf-8", "backslashreplace")  # printable, whatever the name
        return
    assert job is not None and job.name == name == "anything"


# --- the job's own options (timeout, max_attempts) and the typed enqueue ---------------------


@PROPERTY
@given(timeout=integers_and_more)
def test_job_timeout(door: tuple[Harvest, Connection], timeout: Any) -> None:
    app, _ = door
    try:
        registered = app.job("timed", timeout=timeout)(lambda ctx: None)
    except InvalidOption as exc:
        assert exc.option == "timeout", exc
        return
    stored: list[float] = []

    def enqueue(a: Harvest, c: Connection) -> int:
        job_id = registered.options(connection=c).enqueue().id
        sql = text("SELECT timeout FROM harvest_jobs WHERE id = :id")
        stored.append(c.execute(sql, {"id": job_id}).scalar_one())
        return job_id

    try:
        job, refused = attempt(door, enqueue)
    finally:
        app.jobs.pop("timed", None)
    assert refused is None and job is not None
    expected = app.settings.default_timeout if timeout is None else timeout
    assert stored == [float(expected)]
