"""Fair share per tenant (issue 17, item 4): a job's ``tenant`` is stored by every enqueue path
and refused at the door when it is not a name; the claim shares each batch (and each pool's
budget) round-robin by weight across the tenants with due jobs, priority first within one."""

from __future__ import annotations

import secrets
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis
from sqlalchemy import Engine, text

from harvest import migrate, store
from harvest.app import Harvest
from harvest.db import make_engine
from harvest.errors import InvalidOption
from harvest.settings import Settings
from tests.conftest import ADMIN_URL
from tests.integration.test_cli import Cli, base_env


@pytest.fixture
def app(jobs_app: Callable[..., Harvest], redis_client: redis.Redis) -> Harvest:
    return jobs_app(redis_client=redis_client)


def add(
    engine: Engine, n: int, *, tenant: str | None, priority: int = 0, age: float = 10, **cols: Any
) -> list[int]:
    """``n`` due jobs of ``tenant`` in one INSERT ... SELECT generate_series, oldest first."""
    with engine.begin() as conn:
        return list(
            conn.execute(
                text(
                    "INSERT INTO harvest_jobs (name, tenant, priority, run_at, pool, queue) "
                    "SELECT 'noop', :tenant, :p, now() - make_interval(secs => :age - g * 1e-4), "
                    ":pool, :queue FROM generate_series(1, :n) AS g ORDER BY g RETURNING id"
                ),
                {
                    "tenant": tenant,
                    "p": priority,
                    "age": age,
                    "n": n,
                    "pool": cols.get("pool"),
                    "queue": cols.get("queue", "execution"),
                },
            ).scalars()
        )


def claim(engine: Engine, limit: int, **kwargs: Any) -> list[int]:
    with engine.begin() as conn:
        return [c.id for c in store.claim_due(conn, limit=limit, ttl=60, **kwargs)]


def tenants_of(engine: Engine, ids: list[int]) -> list[str | None]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, tenant FROM harvest_jobs WHERE id = ANY(:ids)"), {"ids": ids}
        ).all()
    by_id = {r.id: r.tenant for r in rows}
    return [by_id[i] for i in ids]


# --- at the door ------------------------------------------------------------------------------


def test_every_enqueue_path_stores_the_tenant(app: Harvest, clean_db: Engine) -> None:
    one = app.enqueue("echo", {"value": 1}, tenant="acme").id
    keyed = app.enqueue("echo", {"value": 2}, tenant="acme", idempotency_key="k").id
    many = app.enqueue_many("echo", [{"value": i} for i in range(3)], tenant="o'neil \\N é")
    batch = app.enqueue_batch([("echo", {"value": 9}), ("noop", {})], tenant="b").job_ids
    none = app.enqueue("echo", {"value": 3}).id
    assert app.get(one).tenant == app.get(keyed).tenant == "acme"
    assert tenants_of(clean_db, many) == ["o'neil \\N é"] * 3
    assert tenants_of(clean_db, batch) == ["b", "b"]
    assert app.get(none).tenant is None


def test_typed_enqueue_takes_a_tenant(app: Harvest) -> None:
    @app.job("typed_tenant")
    def typed_tenant(ctx: object, value: int) -> int:
        return value

    ref = typed_tenant.options(tenant="acme", priority=3).enqueue(5)
    job = app.get(ref.id)
    assert (job.tenant, job.priority, job.payload) == ("acme", 3, {"value": 5})


@pytest.mark.parametrize(
    ("tenant", "says"),
    [
        ("", "must not be empty"),
        ("   ", "must not be empty"),
        (7, "must be text"),
        ("x" * 201, "at most 200 characters"),
        ("a\x00b", "must not contain"),
        ("a\nb", "control characters"),
        ("\ud800", "must not contain"),
    ],
)
def test_a_bad_tenant_is_refused_and_nothing_is_stored(
    app: Harvest, clean_db: Engine, tenant: Any, says: str
) -> None:
    calls = (
        lambda: app.enqueue("echo", {"value": 1}, tenant=tenant),
        lambda: app.enqueue_many("echo", [{"value": 1}], tenant=tenant),
        lambda: app.enqueue_batch([("echo", {"value": 1})], tenant=tenant),
    )
    for call in calls:
        with pytest.raises(InvalidOption, match=says) as refused:
            call()
        assert refused.value.option == "tenant"
    with clean_db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM harvest_jobs")).scalar_one() == 0


def test_cli_enqueue_takes_a_tenant(
    migrated: Settings, app: Harvest, clean_db: Engine, redis_client: redis.Redis
) -> None:
    cli = Cli(
        base_env(HARVEST_DATABASE_URL=migrated.database_url, HARVEST_REDIS_URL=migrated.redis_url)
    )
    job_id = int(cli.ok("enqueue", "noop", "--tenant", "acme"))
    assert app.get(job_id).tenant == "acme"
    assert "tenant" in cli.refused("enqueue", "noop", "--tenant", " ")
    assert "acme" in cli.ok("jobs", "show", str(job_id))


def test_tenant_weights_setting_parses_and_checks() -> None:
    parsed = Settings(tenant_weights="acme=3, big=1")  # type: ignore[arg-type]
    assert parsed.tenant_weights == {"acme": 3, "big": 1}
    with pytest.raises(ValueError, match="tenant=n"):
        Settings(tenant_weights="acme")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="from 1 to 1000"):
        Settings(tenant_weights="acme=0")  # type: ignore[arg-type]


# --- the claim --------------------------------------------------------------------------------


def test_a_deep_backlog_does_not_hold_back_a_small_tenant(clean_db: Engine) -> None:
    deep = add(clean_db, 10_000, tenant="A", age=20)  # older than B's: A first by run_at alone
    small = add(clean_db, 10, tenant="B", age=1)
    first = claim(clean_db, 20)
    assert sorted(first) == sorted(deep[:10] + small)  # half each
    # in turns, A then B (each turn ordered by priority, run_at: A's are older)
    assert first == [x for pair in zip(deep[:10], small, strict=True) for x in pair]
    assert claim(clean_db, 20) == deep[10:30]  # B is done: the whole claim is A's again


def test_priority_orders_jobs_within_a_tenant(clean_db: Engine) -> None:
    a_low = add(clean_db, 5, tenant="A", priority=-1)
    a_high = add(clean_db, 5, tenant="A", priority=5)
    b = add(clean_db, 5, tenant="B", priority=0)
    first = claim(clean_db, 6)
    assert [j for j in first if j in set(a_low + a_high)] == a_high[:3]
    assert [j for j in first if j in set(b)] == b[:3]


def test_jobs_without_a_tenant_are_one_tenant(clean_db: Engine) -> None:
    untagged = add(clean_db, 50, tenant=None)
    tagged = add(clean_db, 50, tenant="acme", age=5)
    assert Counter(tenants_of(clean_db, claim(clean_db, 10))) == {None: 5, "acme": 5}
    # and with no tenant at all, the claim is the priority order of before tenants
    with clean_db.begin() as conn:
        conn.execute(text("DELETE FROM harvest_jobs WHERE id = ANY(:ids)"), {"ids": tagged})
    assert claim(clean_db, 10) == untagged[5:15]


def test_weights_give_a_tenant_more_jobs_per_turn(clean_db: Engine) -> None:
    add(clean_db, 200, tenant="A")
    add(clean_db, 200, tenant="B")
    add(clean_db, 200, tenant=None)
    got = Counter(tenants_of(clean_db, claim(clean_db, 50, weights={"A": 3})))
    assert got == {"A": 30, "B": 10, None: 10}


def test_many_small_tenants_each_get_a_turn(clean_db: Engine) -> None:
    add(clean_db, 5000, tenant="deep")
    for i in range(40):
        add(clean_db, 2, tenant=f"t{i:02}")
    got = Counter(tenants_of(clean_db, claim(clean_db, 100)))
    assert all(got[f"t{i:02}"] == 2 for i in range(40)), got
    # Each of the 41 tenants locks about 2 x 100 / 41 rows: the deep one gets its 5, and the
    # claim is not filled up with more of its jobs (the next round is: see the README).
    assert got["deep"] == 5


def test_aging_share_still_comes_first(clean_db: Engine) -> None:
    starving = add(clean_db, 10, tenant="A", priority=-5, age=600)
    add(clean_db, 100, tenant="A", priority=5)
    add(clean_db, 100, tenant="B", priority=5)
    first = claim(clean_db, 20, starvation_after=300)
    assert first[:2] == starving[:2]
    assert Counter(tenants_of(clean_db, first[2:])) == {"A": 9, "B": 9}


def test_a_paused_queue_is_skipped_for_every_tenant(app: Harvest, clean_db: Engine) -> None:
    paused = add(clean_db, 20, tenant="A", queue="bulk") + add(
        clean_db, 5, tenant="B", queue="bulk"
    )
    free = add(clean_db, 5, tenant="A")
    app.pause_queue("bulk")
    assert sorted(claim(clean_db, 50)) == free
    app.resume_queue("bulk")
    assert sorted(claim(clean_db, 50)) == sorted(paused)


def test_a_pool_budget_is_shared_by_the_tenants(clean_db: Engine) -> None:
    add(clean_db, 500, tenant="A", pool="p")
    add(clean_db, 20, tenant="B", pool="p")
    add(clean_db, 50, tenant="C")
    got = claim(clean_db, 40, budgets={"p": 10})
    with clean_db.connect() as conn:
        rows = conn.execute(
            text("SELECT tenant, pool FROM harvest_jobs WHERE id = ANY(:ids)"), {"ids": got}
        ).all()
    in_pool = Counter(r.tenant for r in rows if r.pool == "p")
    assert in_pool == {"A": 5, "B": 5}
    assert len(got) == 40  # the rest of the claim: C's jobs, without a pool


def test_concurrent_claimers_take_disjoint_rows_across_tenants(clean_db: Engine) -> None:
    add(clean_db, 300, tenant="A")
    add(clean_db, 300, tenant="B")
    with clean_db.connect() as one, clean_db.connect() as two:
        first = store.claim_due(one, limit=100, ttl=60)  # not committed yet: rows stay locked
        second = store.claim_due(two, limit=100, ttl=60)
        one.commit()
        two.commit()
    assert len(first) == len(second) == 100
    assert not {c.id for c in first} & {c.id for c in second}


# --- done when: a small tenant's jobs start within a bound under a deep backlog ---------------

WINDOW = 40  # jobs in flight at once: the execution side's capacity
RUN_SECONDS = 0.2  # each job's run time: capacity = WINDOW / RUN_SECONDS = 200 jobs/s


class Executor:
    """A stand-in execution side of fixed capacity, on a thread of its own (as workers run
    beside the dispatcher): every 10 ms, the jobs dispatched RUN_SECONDS ago end."""

    FINISH = text(
        "UPDATE harvest_jobs SET status = 'succeeded', finished_at = now() "
        "WHERE status = 'dispatched' AND dispatched_at <= clock_timestamp() - :run * interval '1s'"
    )

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.01):
            with self.engine.begin() as conn:
                conn.execute(self.FINISH, {"run": RUN_SECONDS})

    def __enter__(self) -> Executor:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def dispatched(engine: Engine, tenant: str, since: float) -> list[float]:
    """Epoch seconds at which ``tenant``'s jobs were claimed, after ``since``."""
    with engine.connect() as conn:
        return [
            float(t)
            for t in conn.execute(
                text(
                    "SELECT extract(epoch FROM dispatched_at) FROM harvest_jobs "
                    "WHERE tenant = :t AND dispatched_at >= to_timestamp(:s)"
                ),
                {"t": tenant, "s": since},
            ).scalars()
        ]


def run_dispatch(app: Harvest, seconds: float) -> None:
    """The dispatcher as beat and nudges run it: one call after another."""
    from harvest import dispatcher

    deadline = app_clock(app) + seconds
    while app_clock(app) < deadline:
        dispatcher.dispatch(app)


def app_clock(app: Harvest) -> float:
    with app.engine.connect() as conn:
        return float(
            conn.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one()
        )


@pytest.fixture
def backlog(settings: Settings) -> Iterator[Settings]:
    """A migrated database of its own, dropped at the end: a deep, analyzed backlog there
    leaves no statistics behind that would change other tests' plans."""
    name = f"harvest_tenants_{secrets.token_hex(4)}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        base = settings.database_url.rsplit("/", 1)[0]
        own = settings.model_copy(update={"database_url": f"{base}/{name}"})
        migrate.upgrade(own, "head")
        yield own
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_the_claim_walks_its_indexes_on_an_analyzed_backlog(backlog: Settings) -> None:
    """100,000 due jobs of one tenant, all in one queue, analyzed: the claim reads about a
    batch of index entries (no sequential scan, no sort of the backlog). The plan checked is
    the one the claim runs with, as the dispatcher calls it: a generic plan (its parameters
    show as ``$n``), made once and kept, printed by auto_explain as each claim runs."""
    engine = make_engine(backlog, pool_size=1)
    try:
        add(engine, 100_000, tenant="A", age=600)
        add(engine, 100, tenant="B")
        with engine.begin() as conn:
            conn.execute(text("ANALYZE harvest_jobs"))
        for budgets in (None, {"p": 10}):
            plans: list[str] = []
            with engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT")
                raw = conn.connection.driver_connection
                assert raw is not None
                raw.add_notice_handler(lambda d, out=plans: out.append(d.message_primary or ""))
                for setting in ("log_min_duration = 0", "log_level = notice"):
                    raw.execute(f"LOAD 'auto_explain'; SET auto_explain.{setting}")
                for _ in range(7):  # past psycopg's and Postgres's first runs
                    assert len(store.claim_due(conn, limit=100, ttl=60, budgets=budgets)) > 0
                raw.execute("RESET auto_explain.log_min_duration")
            plan = [p for p in plans if "Update on harvest_jobs" in p][-1]
            assert "make_interval(0, 0, 0, 0, 0, 0, $" in plan, plan  # generic, not custom
            assert "Seq Scan on harvest_jobs" not in plan, plan
            assert "harvest_jobs_tenant_claim_idx" in plan, plan
            assert "external merge" not in plan, plan
    finally:
        engine.dispose()


def test_small_tenant_starts_within_the_bound_and_the_deep_one_keeps_its_share(
    backlog: Settings, redis_client: redis.Redis
) -> None:
    from tests.helpers import RecordingBroker

    settings = backlog.model_copy(update={"inflight_window": WINDOW, "claim_batch_size": WINDOW})
    app = Harvest(settings, broker=RecordingBroker(settings), redis_client=redis_client)
    app.load_imports(["tests.jobs"])
    engine = app.engine
    add(engine, 100_000, tenant="A", age=60)
    with engine.begin() as conn:
        conn.execute(text("ANALYZE harvest_jobs"))  # plans as on a real backlog
    try:
        with Executor(engine):
            warm_from = app_clock(app)
            run_dispatch(app, 3.0)  # A alone: the capacity actually reached
            capacity = len(dispatched(engine, "A", warm_from)) / (app_clock(app) - warm_from)
            enqueued = app_clock(app)
            app.enqueue_many("noop", [{} for _ in range(100)], tenant="B")
            run_dispatch(app, 10 * 100 / capacity + 2.5)
            ended = app_clock(app)
            b, a = dispatched(engine, "B", enqueued), dispatched(engine, "A", enqueued)
    finally:
        app.close()
    assert len(b) == 100
    b_done = max(b) - enqueued
    bound = 10 * (100 / capacity) + 2
    assert b_done <= bound, (b_done, bound, capacity)
    # Over the same run (B's burst and after), A takes what B leaves of the capacity reached
    # with A alone.
    remaining = capacity * (ended - enqueued) - len(b)
    assert len(a) >= 0.9 * remaining, (len(a), remaining, capacity, b_done)


def test_a_tenant_is_shared_from_its_first_due_job_on_while_one_tenant_took_the_plain_claim(
    clean_db: Engine,
) -> None:
    """With the dispatcher's watch, claims while every job is without a tenant are the plain
    priority claim; a tenant whose jobs arrive then gets its share at the very next claim (the
    plain claim checks for other tenants in its own statement), and at every claim after."""
    watch = store.ClaimWatch()
    plain = add(clean_db, 50, tenant=None)
    assert claim(clean_db, 4, watch=watch) == plain[:4]
    acme = add(clean_db, 50, tenant="acme", priority=-5)  # lower priority: still its turn
    for _ in range(3):
        got = claim(clean_db, 4, watch=watch)
        assert Counter(tenants_of(clean_db, got)) == {None: 2, "acme": 2}
    taken = set(claim(clean_db, 100, watch=watch))
    assert len(taken) == 40 + 44  # the rest of both
    assert set(acme) - taken == set(acme[:6])
