"""enqueue / enqueue_many / get / wait / cancel through Harvest, against the real database."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, text

from harvest import store
from harvest.app import Harvest
from harvest.errors import (
    EnqueueError,
    InvalidJobId,
    InvalidOption,
    InvalidPayload,
    JobNotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    UnknownJob,
    WaitTimeout,
)
from harvest.models import JobStatus
from harvest.settings import Settings

LIMIT = 256 * 1024


@pytest.fixture
def app(migrated: Settings, clean_db: Engine, redis_client: redis.Redis) -> Iterator[Harvest]:
    harvest = Harvest(migrated)
    harvest.load_imports(["tests.jobs"])
    yield harvest
    harvest.close()


def count_jobs(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM harvest_jobs")).scalar_one())


def drop_harvest_connections(engine: Engine) -> int:
    """Postgres drops every harvest connection to the test database but this one's (an
    operator, a restart): how many."""
    with engine.connect() as admin:
        return int(
            admin.execute(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = 'harvest' AND datname = current_database() "
                    "AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
        )


def seed(app: Harvest) -> int:
    """One good job first, so "no row written" is checked against a table that is not empty."""
    return app.enqueue("echo", {"value": "seed"}).id


BAD_ENQUEUES: list[tuple[str, str, dict[str, Any], type[EnqueueError], list[str]]] = [
    ("unknown job", "no_such_job", {}, UnknownJob, ["unknown job 'no_such_job'", "echo"]),
    ("set value", "echo", {"payload": {"value": {1, 2}}}, InvalidPayload, ["set", "payload.value"]),
    ("object value", "echo", {"payload": {"value": object()}}, InvalidPayload, ["object"]),
    ("NaN value", "echo", {"payload": {"value": float("nan")}}, InvalidPayload, ["nan", "JSON"]),
    ("NUL in text", "echo", {"payload": {"value": "a\x00b"}}, InvalidPayload, ["NUL"]),
    ("payload not an object", "echo", {"payload": [1, 2]}, InvalidPayload, ["JSON object"]),
    (
        "oversize payload",
        "echo",
        {"payload": {"value": "x" * LIMIT}},
        PayloadTooLarge,
        [f"limit of {LIMIT} bytes"],
    ),
    (
        "unexpected parameter",
        "echo",
        {"payload": {"colour": "red"}},
        InvalidPayload,
        ["handler's parameters", "colour"],
    ),
    ("parameter for noop", "noop", {"payload": {"x": 1}}, InvalidPayload, ["'x'"]),
    ("negative delay", "echo", {"delay": -5}, InvalidOption, ["invalid delay", "negative"]),
    (
        "negative timedelta",
        "echo",
        {"delay": timedelta(seconds=-1)},
        InvalidOption,
        ["invalid delay", "negative"],
    ),
    (
        "delay and run_at",
        "echo",
        {"delay": 5, "run_at": datetime.now(UTC) + timedelta(minutes=1)},
        InvalidOption,
        ["delay", "run_at", "not both"],
    ),
    (
        "naive run_at",
        "echo",
        {"run_at": datetime(2030, 1, 1)},
        InvalidOption,
        ["run_at", "timezone"],
    ),
    ("priority too high", "echo", {"priority": 5000}, InvalidOption, ["priority", "5000"]),
    ("priority not int", "echo", {"priority": 1.5}, InvalidOption, ["priority", "1.5"]),
    ("max_attempts zero", "echo", {"max_attempts": 0}, InvalidOption, ["max_attempts", "got 0"]),
    ("max_attempts huge", "echo", {"max_attempts": 10**6}, InvalidOption, ["max_attempts"]),
    ("empty idempotency key", "echo", {"idempotency_key": ""}, InvalidOption, ["idempotency_key"]),
    # Accepted by the checks today, refused by Postgres with a raw driver error:
    (
        "lone surrogate",
        "echo",
        {"payload": {"value": "half \ud800 of a pair"}},
        InvalidPayload,
        ["payload.value"],
    ),
    ("delay past year 294276", "echo", {"delay": 1e13}, InvalidOption, ["delay"]),
]


@pytest.mark.parametrize(
    ("name", "kwargs", "error", "fragments"),
    [case[1:] for case in BAD_ENQUEUES],
    ids=[case[0] for case in BAD_ENQUEUES],
)
def test_bad_enqueue_raises_typed_error_and_stores_nothing(
    app: Harvest,
    clean_db: Engine,
    name: str,
    kwargs: dict[str, Any],
    error: type[EnqueueError],
    fragments: list[str],
) -> None:
    seed(app)
    before = count_jobs(clean_db)
    raised: BaseException | None = None
    try:
        app.enqueue(name, **kwargs)
    except Exception as exc:
        raised = exc
    assert count_jobs(clean_db) == before, "a refused enqueue wrote a row"
    assert isinstance(raised, error), f"expected {error.__name__}, got {raised!r}"
    for fragment in fragments:
        assert fragment in str(raised), (fragment, str(raised))


def test_oversize_payload_reports_its_size(app: Harvest, clean_db: Engine) -> None:
    with pytest.raises(PayloadTooLarge) as info:
        app.enqueue("echo", {"value": "x" * LIMIT})
    assert info.value.limit == LIMIT
    assert info.value.size == len('{"value":""}') + LIMIT
    assert count_jobs(clean_db) == 0


def test_good_enqueue_stores_what_was_asked(app: Harvest) -> None:
    run_at = datetime.now(UTC) + timedelta(hours=1)
    ref = app.enqueue("echo", {"value": [1, "two"]}, priority=7, run_at=run_at, max_attempts=9)
    assert ref.created
    job = app.get(ref.id)
    assert (job.name, job.payload, job.priority, job.max_attempts) == (
        "echo",
        {"value": [1, "two"]},
        7,
        9,
    )
    assert job.status is JobStatus.PENDING
    assert abs((job.run_at - run_at).total_seconds()) < 0.001


def test_delay_is_measured_on_the_database_clock(app: Harvest, clean_db: Engine) -> None:
    ref = app.enqueue("echo", {}, delay=timedelta(minutes=10))
    with clean_db.connect() as conn:
        ahead = conn.execute(
            text("SELECT extract(epoch FROM run_at - now()) FROM harvest_jobs WHERE id = :id"),
            {"id": ref.id},
        ).scalar_one()
    assert 590 < float(ahead) <= 600


# --- enqueue_many ---------------------------------------------------------------------------


BAD_ITEMS: list[tuple[str, dict[str, Any], type[EnqueueError]]] = [
    ("set", {"value": {1}}, InvalidPayload),
    ("unexpected parameter", {"colour": "red"}, InvalidPayload),
    ("oversize", {"value": "x" * LIMIT}, PayloadTooLarge),
]


@pytest.mark.parametrize("index", [0, 1, 500, 999])
@pytest.mark.parametrize(
    ("bad", "error"), [c[1:] for c in BAD_ITEMS], ids=[c[0] for c in BAD_ITEMS]
)
def test_enqueue_many_with_one_bad_item_stores_nothing_and_names_it(
    app: Harvest, clean_db: Engine, index: int, bad: dict[str, Any], error: type[EnqueueError]
) -> None:
    seed(app)
    payloads: list[dict[str, Any]] = [{"value": i} for i in range(1000)]
    payloads[index] = bad
    with pytest.raises(error) as info:
        app.enqueue_many("echo", payloads)
    assert count_jobs(clean_db) == 1
    assert str(info.value).startswith(f"item {index}: "), str(info.value)
    assert info.value.index == index


def test_enqueue_many_failing_in_a_later_chunk_stores_nothing(
    app: Harvest, clean_db: Engine
) -> None:
    """All stored or none, also when the database refuses a row of the second chunk."""
    payloads: list[dict[str, Any]] = [{"value": i} for i in range(1000)]
    payloads[700] = {"value": "half \ud800 of a pair"}
    raised: BaseException | None = None
    try:
        app.enqueue_many("echo", payloads, chunk_size=500)
    except Exception as exc:
        raised = exc
    assert count_jobs(clean_db) == 0, "the first chunk was stored"
    assert isinstance(raised, InvalidPayload), repr(raised)
    assert str(raised).startswith("item 700: ")


def test_enqueue_many_stores_n_rows_in_order(app: Harvest, clean_db: Engine) -> None:
    n = 2345
    ids = app.enqueue_many("echo", [{"value": i} for i in range(n)], priority=3, chunk_size=1000)
    assert len(ids) == n
    assert len(set(ids)) == n
    assert ids == sorted(ids)
    with clean_db.connect() as conn:
        rows = conn.execute(
            text("SELECT id, payload, priority, status FROM harvest_jobs ORDER BY id")
        ).all()
    assert [r.id for r in rows] == ids
    assert [r.payload for r in rows] == [{"value": i} for i in range(n)]
    assert {(r.priority, r.status) for r in rows} == {(3, "pending")}


def test_enqueue_many_delay_and_options_are_stored_on_every_row(
    app: Harvest, clean_db: Engine
) -> None:
    """The bulk path (COPY) stores what the single path does; the delay counts from the
    database's clock (run_at - created_at is the delay, both read from Postgres)."""
    ids = app.enqueue_many("echo", [{"value": i} for i in range(300)], delay=90, max_attempts=7)
    with clean_db.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT extract(epoch FROM run_at - created_at) AS lag, max_attempts, queue, "
                "name, attempts, status FROM harvest_jobs WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        ).all()
    assert len(rows) == 300
    assert {
        (float(r.lag), r.max_attempts, r.queue, r.name, r.attempts, r.status) for r in rows
    } == {(90.0, 7, "execution", "echo", 0, "pending")}
    later = app.enqueue("echo", {"value": -1})  # the sequence moved past the bulk rows' ids
    assert later.id > max(ids)


@pytest.mark.parametrize(
    "options",
    [{}, {"priority": -5, "tenant": "acme"}, {"run_at": datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)}],
    ids=["defaults", "priority-tenant", "run_at"],
)
def test_enqueue_many_stores_the_row_a_single_enqueue_stores(
    app: Harvest, clean_db: Engine, options: dict[str, Any]
) -> None:
    """The bulk path leaves columns at their defaults to the table (a job due now gets the
    transaction's now(), as a single INSERT's default gives): every row reads as a single
    enqueue's with the same options, due now when no time was given."""
    bulk = app.enqueue_many("echo", [{"value": 1}, {"value": 2}], **options)
    single = app.enqueue("echo", {"value": 3}, **options).id
    columns = (
        "name, queue, priority, max_attempts, timeout, pool, tenant, status, attempts,"
        " run_at = created_at AS due_at_creation,"
        " run_at = :run_at AS at_run_at"
    )
    with clean_db.connect() as conn:
        rows = conn.execute(
            text(f"SELECT id, {columns} FROM harvest_jobs WHERE id = ANY(:ids) ORDER BY id"),
            {"ids": [*bulk, single], "run_at": options.get("run_at")},
        ).all()
    shapes = {tuple(r)[1:] for r in rows}
    assert len(rows) == 3 and len(shapes) == 1, rows
    (shape,) = shapes
    assert shape[:3] == ("echo", "execution", options.get("priority", 0))
    assert shape[6] == options.get("tenant")
    assert shape[-2] is ("run_at" not in options)  # due now: run_at is the creation's now()
    assert shape[-1] is (True if "run_at" in options else None)


def test_enqueue_many_stores_awkward_text_exactly(app: Harvest, clean_db: Engine) -> None:
    """Bulk rows go through COPY's text format: backslashes, tabs, newlines, a literal \\N,
    quotes and non-ASCII text must come back as they went in."""
    values = [
        "back\\slash", "tab\there", "new\nline", "cr\rret", "\\N", "\\\\N", '"quoted"',
        "émoji 🌾", "\u2028sep", "", "end\\",
    ]  # fmt: skip
    ids = app.enqueue_many("echo", [{"value": v} for v in values])
    with clean_db.connect() as conn:
        stored = conn.execute(
            text("SELECT payload FROM harvest_jobs WHERE id = ANY(:ids) ORDER BY id"), {"ids": ids}
        ).scalars()
        assert [p["value"] for p in stored] == values


def test_enqueue_many_of_nothing_stores_nothing(app: Harvest, clean_db: Engine) -> None:
    assert app.enqueue_many("echo", []) == []
    assert count_jobs(clean_db) == 0


def test_enqueue_many_refuses_bad_options_before_storing(app: Harvest, clean_db: Engine) -> None:
    with pytest.raises(InvalidOption, match="priority"):
        app.enqueue_many("echo", [{"value": 1}] * 10, priority=-5000)
    with pytest.raises(UnknownJob):
        app.enqueue_many("nope", [{}] * 10)
    assert count_jobs(clean_db) == 0


# --- idempotency ----------------------------------------------------------------------------


def test_second_enqueue_with_same_key_returns_the_first_job(app: Harvest, clean_db: Engine) -> None:
    first = app.enqueue("echo", {"value": 1}, idempotency_key="order-42")
    second = app.enqueue("echo", {"value": 2}, idempotency_key="order-42")
    other = app.enqueue("echo", {"value": 3}, idempotency_key="order-43")
    assert first.created
    assert second.id == first.id
    assert not second.created
    assert other.created
    assert other.id != first.id
    assert count_jobs(clean_db) == 2
    assert app.get(first.id).payload == {"value": 1}
    assert app.get(first.id).idempotency_key == "order-42"


def test_idempotent_enqueue_keeps_delay(app: Harvest, clean_db: Engine) -> None:
    ref = app.enqueue("echo", {}, idempotency_key="later", delay=600)
    with clean_db.connect() as conn:
        ahead = conn.execute(
            text("SELECT extract(epoch FROM run_at - now()) FROM harvest_jobs WHERE id = :id"),
            {"id": ref.id},
        ).scalar_one()
    assert 590 < float(ahead) <= 600


def test_concurrent_enqueues_with_one_key_make_one_job(app: Harvest, clean_db: Engine) -> None:
    threads_n = 32
    barrier = threading.Barrier(threads_n)
    results: list[Any] = [None] * threads_n

    def enqueue(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            results[i] = app.enqueue("echo", {"value": i}, idempotency_key="same-key")
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=enqueue, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    errors = [r for r in results if isinstance(r, BaseException) or r is None]
    assert not errors, errors[:3]
    assert len({r.id for r in results}) == 1
    assert sum(r.created for r in results) == 1
    with clean_db.connect() as conn:
        rows = conn.execute(
            text("SELECT count(*) FROM harvest_jobs WHERE idempotency_key = 'same-key'")
        ).scalar_one()
    assert rows == 1
    assert count_jobs(clean_db) == 1


# --- get, wait, cancel ----------------------------------------------------------------------


def test_get_of_missing_id_raises_job_not_found(app: Harvest) -> None:
    with pytest.raises(JobNotFound, match="no job with id 987654") as info:
        app.get(987654)
    assert info.value.job_id == 987654
    with pytest.raises(JobNotFound):
        app.wait(987654, timeout=0.1)
    with pytest.raises(JobNotFound):
        app.cancel(987654)


def test_a_job_is_named_by_the_ref_enqueue_returned(app: Harvest) -> None:
    ref = app.enqueue("echo", {"value": 1}, delay=3600)
    job = app.get(ref)
    assert (job.id, job.status) == (ref.id, JobStatus.PENDING)
    assert app.get(job) == job
    assert app.get(job_id=ref) == app.get(job_id=ref.id) == job  # the keyword it always had
    assert app.cancel(ref) == JobStatus.CANCELLED
    assert app.wait(ref, timeout=1).status == JobStatus.CANCELLED
    assert app.get(ref.id).status == JobStatus.CANCELLED


@pytest.mark.parametrize("given", [str, bool, float], ids=lambda t: t.__name__)
def test_a_job_named_by_anything_else_is_refused_before_any_query(
    app: Harvest, given: type
) -> None:
    ref = app.enqueue("echo", {"value": 1}, delay=3600)
    value = given(ref.id)
    for call in (app.get, app.wait, app.cancel, app.retry):
        with pytest.raises(InvalidJobId, match=f"not by a {given.__name__}") as info:
            call(value)
        assert info.value.given == given.__name__
    assert app.get(ref).status == JobStatus.PENDING  # the cancel asked nothing of it


def test_an_id_no_bigint_holds_names_no_job(app: Harvest) -> None:
    for call in (app.get, app.wait, app.cancel, app.retry):
        with pytest.raises(JobNotFound, match=f"no job with id {2**63}"):
            call(2**63)


def test_wait_times_out_with_the_status(app: Harvest) -> None:
    ref = app.enqueue("echo", {}, delay=3600)
    started = time.monotonic()
    with pytest.raises(WaitTimeout) as info:
        app.wait(ref.id, timeout=0.4)
    elapsed = time.monotonic() - started
    assert 0.4 <= elapsed < 3
    assert info.value.job_id == ref.id
    assert info.value.status == "pending"
    assert f"job {ref.id} still pending after 0.4s" in str(info.value)


def test_wait_returns_a_finished_job(app: Harvest, clean_db: Engine) -> None:
    ref = app.enqueue("echo", {})
    assert app.cancel(ref.id) is JobStatus.CANCELLED
    assert app.wait(ref.id, timeout=1).status is JobStatus.CANCELLED


def test_cancel_of_pending_job_is_immediate_and_never_claimed(
    app: Harvest, clean_db: Engine
) -> None:
    cancelled = app.enqueue("echo", {"value": "cancel me"}, priority=1000)
    kept = app.enqueue("echo", {"value": "keep me"})
    assert app.cancel(cancelled.id) is JobStatus.CANCELLED
    job = app.get(cancelled.id)
    assert job.status is JobStatus.CANCELLED
    assert job.finished_at is not None
    with clean_db.begin() as conn:
        claimed = store.claim_due(conn, limit=10, ttl=60)
    assert [c.id for c in claimed] == [kept.id]
    assert app.get(cancelled.id).status is JobStatus.CANCELLED
    assert app.get(cancelled.id).dispatched_at is None
    # Cancelling a finished job changes nothing and says what it is.
    assert app.cancel(cancelled.id) is JobStatus.CANCELLED


def test_a_connection_dropped_while_in_steady_use_fails_one_enqueue_clearly_then_is_replaced(
    app: Harvest, clean_db: Engine
) -> None:
    """Within ``TRUSTED_FOR`` of its last use a pooled connection is not pinged, so an enqueue
    on one that Postgres dropped just then fails: with harvest's ServiceUnavailable (not a
    driver error), nothing stored, and the pool's connections of that generation are replaced,
    so the next enqueue succeeds at once."""
    seed(app)  # the queue's depth counted: the next enqueues, within a second, are one statement
    killed = drop_harvest_connections(clean_db)
    assert killed >= 1
    with pytest.raises(ServiceUnavailable, match="Postgres"):
        app.enqueue("echo", {"value": "lost"})
    ref = app.enqueue("echo", {"value": "after"})
    assert ref.created and app.get(ref.id).status == JobStatus.PENDING
    clean_db.dispose()  # the test's own pooled connection was dropped too
    assert count_jobs(clean_db) == 2


def test_the_connection_of_a_one_statement_enqueue_goes_back_to_the_pool_out_of_autocommit(
    migrated: Settings, clean_db: Engine
) -> None:
    """The one-statement enqueue runs in autocommit on a pooled connection; the next user of
    that connection (here a caller's transaction on the pool's only connection) gets it back
    in transactions again: a job enqueued in it and rolled back is not stored."""
    single = Harvest(migrated.model_copy(update={"db_pool_size": 1, "db_max_overflow": 0}))
    single.load_imports(["tests.jobs"])
    try:
        counted = single.enqueue("echo", {"value": "counted"})  # the queue's depth counted
        kept = single.enqueue("echo", {"value": "fast path"})  # within a second: one statement
        session = single.sessions()
        try:
            undone = single.enqueue("echo", {"value": "rolled back"}, connection=session)
            session.rollback()
        finally:
            session.close()
        assert count_jobs(clean_db) == 2
        assert {single.get(j.id).status for j in (counted, kept)} == {JobStatus.PENDING}
        with pytest.raises(JobNotFound):
            single.get(undone.id)
    finally:
        single.close()


def test_an_enqueue_after_postgres_dropped_its_idle_connection_succeeds(
    app: Harvest, clean_db: Engine
) -> None:
    """An enqueue is one round trip while its pooled connection is in steady use (no ping);
    a connection idle for longer than ``TRUSTED_FOR`` is pinged first, so one that Postgres
    dropped meanwhile (a restart, an idle timeout, an operator) is replaced, not failed on."""
    from harvest.db import TRUSTED_FOR

    seed(app)
    killed = drop_harvest_connections(clean_db)
    assert killed >= 1  # the app's own connection among them
    time.sleep(TRUSTED_FOR + 0.1)
    ref = app.enqueue("echo", {"value": "after"})
    assert ref.created and app.get(ref.id).status == JobStatus.PENDING
    assert count_jobs(clean_db) == 2
