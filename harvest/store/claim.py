"""The dispatch side: the SKIP LOCKED claim of due jobs (run hundreds of times a second,
prepared on the driver connection), jobs in flight, and recent run times."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Integer, TextClause, bindparam, text

from harvest.execution import sql as statements
from harvest.jobs import Claimed
from harvest.store.quarantine import READABLE_FROM

# --- dispatch -------------------------------------------------------------------------------

_INFLIGHT = text("SELECT count(*) FROM harvest_jobs WHERE status IN ('dispatched', 'running')")


def inflight(conn: Connection) -> int:
    return int(conn.execute(_INFLIGHT).scalar_one())


_IN_FLIGHT_BY_POOL = text(
    """
    SELECT pool, count(*) AS n FROM harvest_jobs
    WHERE status IN ('dispatched', 'running') AND pool = ANY(:pools)
    GROUP BY pool
    """
)


def in_flight_by_pool(conn: Connection, pools: Sequence[str]) -> dict[str, int]:
    """Jobs of each pool dispatched or running: each holds a key of it, or will need one (sent
    and not started, or started and waiting at the gate for a key to free)."""
    rows = conn.execute(_IN_FLIGHT_BY_POOL, {"pools": list(pools)})
    return {r.pool: int(r.n) for r in rows}


# Every claim marks its chosen rows dispatched with this one UPDATE. The chosen rows are found
# again by their ids: ``j.id = ANY(...)`` gives the generic plan an
# index path whatever it guesses of ``chosen``. Without it, the generic plan guessed a hundred
# rows chosen and, on a table of a few to twenty thousand rows, hash-joined them to a
# sequential scan of the whole table (measured: 2.6 ms a claim of one row at 19,358 rows,
# against 1.0 ms at 20,000, where the guess tipped the other way).
# The rows come back in claim order, sorted by Postgres: the aged share first (oldest first:
# its turn is 0 and its priority left out), then by turn, priority, run_at. Sorting them in
# Python, from rows carrying the sort keys, was 1.2 us a row (a sixth of a claim of 100).
_DISPATCH_CHOSEN = """
        UPDATE harvest_jobs AS j
        SET status = 'dispatched', lease_token = gen_random_uuid(), dispatched_at = now(),
            lease_expires_at = now() + make_interval(secs => :ttl)
        FROM chosen WHERE j.id = chosen.id AND j.id = ANY(ARRAY(SELECT id FROM chosen))"""
_CLAIM_UPDATE = f"""
    , claimed AS ({_DISPATCH_CHOSEN}
        RETURNING j.id, j.lease_token, j.queue, j.name, j.priority, j.run_at, chosen.aged,
                  chosen.turn
    )
    SELECT id, lease_token, queue, name, aged FROM claimed
    ORDER BY aged DESC, turn, CASE WHEN aged THEN 0 ELSE priority END DESC, run_at, id
    """


# A paused queue's jobs are not claimed (migration 0009): the paused set is read once per
# statement (an InitPlan), in the claim's own snapshot, so one statement still decides it all.
# Written as array containment, not ``queue <> ALL(...)``: with every pending job in one queue
# (one distinct value) the planner read ``<> ALL`` of an unknown array as matching no row, and
# on an analyzed table sorted the whole backlog instead of walking the claim index.
_NOT_PAUSED = "NOT (ARRAY[queue] <@ ARRAY(SELECT queue FROM harvest_queue_pauses))"

_CLAIM_AGED = f"""
    aged AS (
        SELECT id, pool, priority, run_at, true AS aged, CAST(0 AS float8) AS turn
        FROM harvest_jobs
        WHERE status = 'pending' AND run_at <= now() - make_interval(secs => :starve)
          AND run_at >= {READABLE_FROM} AND {_NOT_PAUSED}
        ORDER BY run_at, id
        LIMIT :share
        FOR UPDATE SKIP LOCKED
    )"""

# The tenants with pending jobs, by a loose index scan of ``harvest_jobs_tenant_claim_idx``
# (one index descent per tenant, however deep its backlog; NULL is the tenant ''), each with
# its weight and how many of its best due rows to lock: its weighted part of ``:spread``,
# at most ``:deep``. The scan walks the index backwards: a tenant's entries start with the
# rows claimed since the last vacuum (dead to the claim, still in the index), and a forward
# probe stepped over all of them, as the claim's own scan does once more (measured: 1,162
# buffers a probe after 100,000 claimed rows, against 4 backwards).
_TENANT = "COALESCE(tenant, '')"
_CLAIM_TENANTS = f"""
    tenants AS (
        (SELECT {_TENANT} AS k FROM harvest_jobs WHERE status = 'pending'
         ORDER BY 1 DESC LIMIT 1)
        UNION ALL
        SELECT (SELECT {_TENANT} FROM harvest_jobs
                WHERE status = 'pending' AND {_TENANT} < t.k ORDER BY 1 DESC LIMIT 1)
        FROM tenants AS t WHERE t.k IS NOT NULL
    ), weighted AS (
        SELECT t.k, COALESCE(w.weight, 1) AS weight FROM tenants AS t
        LEFT JOIN unnest(CAST(:tenants AS text[]), CAST(:weights AS int[])) AS w(k, weight)
               ON w.k = t.k
        WHERE t.k IS NOT NULL
    ), shares AS (
        SELECT k, weight,
               CAST(LEAST(:deep, ceil(:spread * weight / sum(weight) OVER ())) AS int) AS take
        FROM weighted
    )"""

# Each tenant's best due rows (priority, then run_at), locked; ``turn`` is the round of the
# weighted round-robin a row falls in: a tenant of weight w has w rows in each round.
_CLAIM_FRESH = f"""
    fresh AS (
        SELECT f.*, s.k AS tenant_key,
               CAST(row_number() OVER (PARTITION BY s.k ORDER BY f.priority DESC, f.run_at, f.id)
                    - 1 AS float8) / s.weight AS turn
        FROM shares AS s CROSS JOIN LATERAL (
            SELECT id, pool, priority, run_at, false AS aged FROM harvest_jobs
            WHERE {_TENANT} = s.k AND status = 'pending' AND run_at <= now()
              AND run_at >= {READABLE_FROM} AND {_NOT_PAUSED}
              AND id <> ALL(ARRAY(SELECT id FROM aged))
            ORDER BY priority DESC, run_at, id
            LIMIT s.take
            FOR UPDATE SKIP LOCKED
        ) AS f
    )"""

_FAIR = "turn, priority DESC, run_at, id"


def _plain_claim() -> str:
    """The claim without budgets: the aged share, then up to ``:limit`` rows in turn order."""
    return f"""
            WITH RECURSIVE {_CLAIM_AGED}, {_CLAIM_TENANTS}, {_CLAIM_FRESH},
            chosen AS (
                SELECT id, aged, turn FROM aged
                UNION ALL
                (SELECT id, aged, turn FROM fresh ORDER BY {_FAIR}
                 LIMIT :limit - (SELECT count(*) FROM aged))
            ) {_CLAIM_UPDATE}"""


def _budgeted_claim() -> str:
    """The claim with ``budget`` rows at most of each named pool, shared by the tenants in
    turn order."""
    order = f"aged DESC, {_FAIR}"
    return f"""
        WITH RECURSIVE {_CLAIM_AGED}, {_CLAIM_TENANTS}, {_CLAIM_FRESH},
        cand AS (
            SELECT id, pool, priority, run_at, aged, turn FROM aged
            UNION ALL SELECT id, pool, priority, run_at, aged, turn FROM fresh
        ), ranked AS (
            SELECT c.id, c.aged, c.turn, c.priority, c.run_at, b.budget,
                   row_number() OVER (PARTITION BY c.pool ORDER BY {order}) AS rn
            FROM cand AS c
            LEFT JOIN unnest(CAST(:pools AS text[]), CAST(:budgets AS int[])) AS b(pool, budget)
                   ON b.pool = c.pool
        ), chosen AS (
            SELECT id, aged, turn FROM ranked WHERE budget IS NULL OR rn <= budget
            ORDER BY {order}
            LIMIT :limit
        ) {_CLAIM_UPDATE}"""


def _claim_statement(*, budgeted: bool) -> TextClause:
    """The claim, in one statement (one round trip, atomic on its own): due pending rows,
    locked with SKIP LOCKED, marked dispatched with a fresh lease token.

    Two scans feed it. ``aged``: up to ``:share`` rows due for longer than ``:starve`` seconds,
    oldest first, of any tenant (the aging share; index ``harvest_jobs_age_idx``; with
    ``:share`` 0 it reads nothing). ``fresh``: per tenant with pending jobs (found by a loose
    index scan), its best due rows by priority (``harvest_jobs_tenant_claim_idx``), at most
    ``:deep`` and about its weighted part of ``:spread``; the claim then takes them round-robin
    (``turn``: a tenant's n-th row over its weight), priority first within a turn. With one
    tenant (every job without one) that is the priority order of before. Each scan's LIMIT is
    bounded by a plain parameter, so the planner walks the index and stops; ``fresh`` may lock
    rows it does not take (at most ``:spread`` plus one per tenant), until the statement commits.
    ``budgeted``: at most ``budget`` rows of each named key pool, in the same turn order.
    Neither scan takes a job of a paused queue (``harvest_queue_pauses``).

    A row whose ``run_at`` Python cannot hold (written around the door) is never claimed, and
    ``run_at`` does not come back (it orders the rows in Postgres): no value of a claimed row
    can fail to be read after the claim committed (:func:`quarantine_pending` fails such
    rows)."""
    return text(_budgeted_claim() if budgeted else _plain_claim())


_CLAIMS = {budgeted: _claim_statement(budgeted=budgeted) for budgeted in (False, True)}


_CLAIMS_SQL = {
    budgeted: statements.psycopg_style(clause.text) for budgeted, clause in _CLAIMS.items()
}


# The claim while no pending job has a tenant (every job is the tenant ''), no starving job is
# looked for and no pool has a budget: the fair claim then takes the best due rows by
# priority, and this is that claim without the tenants' round-robin (its scans, window
# functions and sorts were a third of a claim's time in Postgres). Whether another tenant has
# a pending job is read in the same statement (one descent of the tenants' index, written as
# its first entry past '' so that the planner walks the index: as ``EXISTS`` it read the
# whole table), before any row is locked; if one has, nothing is claimed, one row with
# ``others`` true comes back, and the full claim runs instead.
_ONE_TENANT = statements.psycopg_style(
    f"""
    WITH others AS MATERIALIZED (
        SELECT (SELECT {_TENANT} FROM harvest_jobs WHERE status = 'pending' AND {_TENANT} > ''
                ORDER BY 1 LIMIT 1) IS NOT NULL AS found
    ), chosen AS (
        SELECT id FROM harvest_jobs
        WHERE {_TENANT} = '' AND status = 'pending' AND run_at <= now()
          AND run_at >= {READABLE_FROM} AND {_NOT_PAUSED}
          AND NOT (SELECT found FROM others)
        ORDER BY priority DESC, run_at, id
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ), claimed AS ({_DISPATCH_CHOSEN}
        RETURNING j.id, j.lease_token, j.queue, j.name, j.priority, j.run_at
    )
    (SELECT id, lease_token, queue, name, false AS aged, false AS others FROM claimed
     ORDER BY priority DESC, run_at, id)
    UNION ALL
    SELECT NULL, NULL, NULL, NULL, false, true FROM others WHERE found
    """
)


def aging_share(limit: int) -> int:
    """How many rows of a claim of ``limit`` go to jobs waiting past the starvation threshold:
    10 %, at least one."""
    return min(limit, max(1, limit // 10)) if limit > 0 else 0


class ClaimWatch:
    """What a dispatcher's claims remember between them, so that a claim does only the work
    its situation needs. One for each dispatching app (:mod:`harvest.dispatcher`).

    **Starving jobs** (the aging share). Looking for them is an index probe of every claim,
    and with nothing starving it finds nothing, hundreds of times a second. A watch looks at
    every claim while its last look found a starving job (more may be waiting), and otherwise
    once every ``every`` seconds, at most a tenth of the threshold: a job that starts starving
    is claimed at most that much later than with a look at every claim, and a backlog of them
    still takes its share of every claim.

    **Tenants.** While no job has a tenant, the claim is the plain priority claim
    (:data:`_ONE_TENANT`), which checks in the same statement that no other tenant has a
    pending job and otherwise claims nothing and says so; the full claim then runs. A watch
    that saw other tenants goes to the full claim directly for ``every`` seconds."""

    EVERY = 1.0

    def __init__(self, every: float = EVERY) -> None:
        self.every = every
        self._look_at = 0.0  # monotonic; the first claim looks
        self._tenants_until = 0.0

    def looks(self) -> bool:
        return time.monotonic() >= self._look_at

    def saw(self, aged: int, starvation_after: float) -> None:
        """What a look found: ``aged`` starving jobs claimed."""
        wait = 0.0 if aged else min(self.every, starvation_after / 10)
        self._look_at = time.monotonic() + wait

    def tenants(self) -> bool:
        """Whether other tenants were seen within ``every`` seconds."""
        return time.monotonic() < self._tenants_until

    def saw_tenants(self) -> None:
        self._tenants_until = time.monotonic() + self.every


# What the planner believes of the pending jobs: the rows it expects for the predicate every
# claim index shares; how many there are, counted up to a bound (one index walk of at most that
# many entries); and the statistics made afresh, unless another ANALYZE (autovacuum's) holds
# the table, which then makes them itself.
_PLANNED_PENDING = "EXPLAIN (FORMAT JSON) SELECT 1 FROM harvest_jobs WHERE status = 'pending'"
_COUNT_PENDING = (
    "SELECT count(*) FROM (SELECT 1 FROM harvest_jobs WHERE status = 'pending' LIMIT %(most)s) p"
)
_ANALYZE = "ANALYZE (SKIP_LOCKED) harvest_jobs"


def planned_pending(conn: Connection) -> int:
    """How many pending jobs Postgres' planner expects in ``harvest_jobs`` (its statistics'
    figure, not a count)."""
    plan = conn.exec_driver_sql(_PLANNED_PENDING).scalar_one()
    return int(plan[0]["Plan"]["Plan Rows"])


@dataclass(frozen=True, slots=True)
class Analyzed:
    """A :class:`StatsWatch` found the statistics stale and made them afresh."""

    planned: int  # pending jobs the planner expected before
    pending: int  # pending jobs there were, counted up to StatsWatch.COUNT_UP_TO
    seconds: float  # the ANALYZE's time
    after: int  # pending jobs it expects now (unchanged: the ANALYZE was skipped)


class StatsWatch:
    """Whether the planner's statistics of ``harvest_jobs`` still describe its pending jobs,
    checked after claims. One for each dispatching app.

    The claim's plan depends on them. Statistics made while the table held no pending job
    (every job finished, then ANALYZE) say a claim finds about one row; after a burst of
    enqueued jobs the planner then reads every pending row through any index of them and sorts
    them all for each claim, instead of walking the claim's index for ``limit`` rows: measured,
    43 ms a claim of 100 against 4 at 20,000 pending jobs, until autovacuum analyzes the table
    (its launcher looks once a minute). After a claim that took rows, at most every
    ``check_every`` seconds, the watch asks the planner what it expects; below
    ``COUNT_UP_TO / STALE_RATIO`` it counts the pending jobs up to ``COUNT_UP_TO``, and when
    there are more than ``STALE_RATIO`` times what the planner expects, runs ``ANALYZE`` at once:
    a sample of the table, after which every connection's cached plans of it are made again.
    Postgres skips it, with a warning, while another ANALYZE holds the table or when harvest's
    role does not own it, and on a large table its sample may miss a few pending rows: where
    the figure after still says they are stale, the watch makes the next only
    ``analyze_every`` seconds later. One that made them describe the backlog does not hold the
    next back: a burst that comes seconds after the last one drained (the table analyzed empty
    in between) gets its own at its first claim, where waiting left its claims reading and
    sorting the whole backlog, 100-400 ms each, for up to 10 s (measured 2026-12-05). Jobs
    claimed as fast as they come leave few pending at the check, and no ANALYZE."""

    CHECK_EVERY = 1.0
    ANALYZE_EVERY = 10.0
    COUNT_UP_TO = 1000
    STALE_RATIO = 10

    def __init__(
        self, check_every: float = CHECK_EVERY, analyze_every: float = ANALYZE_EVERY
    ) -> None:
        self.check_every, self.analyze_every = check_every, analyze_every
        self._check_at = 0.0  # monotonic
        self._analyze_at = 0.0

    def claimed(self, conn: Connection, got: int) -> Analyzed | None:
        """After a claim that took ``got`` rows: analyze if it is due. A claim that found
        nothing makes the next that takes rows check at once: they are a new burst's."""
        now = time.monotonic()
        if got <= 0:
            self._check_at = 0.0
            return None
        if now < self._check_at:
            return None
        self._check_at = now + self.check_every
        planned = planned_pending(conn)
        if planned * self.STALE_RATIO >= self.COUNT_UP_TO or now < self._analyze_at:
            return None
        most = {"most": self.COUNT_UP_TO}
        pending = int(conn.exec_driver_sql(_COUNT_PENDING, most).scalar_one())
        if pending <= planned * self.STALE_RATIO:
            return None
        started = time.perf_counter()
        conn.exec_driver_sql(_ANALYZE)
        seconds = time.perf_counter() - started
        after = planned_pending(conn)
        if pending > after * self.STALE_RATIO:  # still stale: skipped, or the sample missed
            self._analyze_at = now + self.analyze_every
        return Analyzed(planned, pending, seconds, after)


def claim_round(conn: Connection) -> contextlib.AbstractContextManager[None]:
    """A block of claims on one autocommit connection (a dispatch call's rounds): its
    statements plan generically, the setting made once for the block rather than around each
    claim (:func:`harvest.execution.sql.generic_plans`). Every statement of the store that a
    dispatch call runs takes a generic plan as well as a custom one."""
    return statements.generic_plans(conn)


def claim_due(
    conn: Connection,
    *,
    limit: int,
    ttl: float,
    budgets: Mapping[str, int] | None = None,
    starvation_after: float | None = None,
    weights: Mapping[str, int] | None = None,
    watch: ClaimWatch | None = None,
) -> list[Claimed]:
    """Claim up to ``limit`` due pending jobs in one statement, shared fairly by the tenants
    with due jobs: round-robin, a tenant's jobs by priority, then oldest run_at.

    ``FOR UPDATE SKIP LOCKED`` makes concurrent claimers take disjoint rows; each claimed row
    gets a fresh lease token and an expiry after which rescue takes it back. With ``budgets``
    ({pool: n}), no more than n jobs of each named pool are claimed (the keys it can serve
    now), shared by the tenants in the same turns; it looks about 4 x ``limit`` due rows deep.

    ``weights`` ({tenant: w}, w >= 1, default 1): a tenant of weight w gets w jobs in each
    round of the round-robin. Jobs without a tenant are one tenant of their own (weight 1).

    With ``starvation_after`` (seconds), jobs due for longer than that first take up to
    :func:`aging_share` of the claim, oldest first, whatever their priority or tenant: a
    low-priority job under a flood of higher-priority ones is still claimed eventually. With
    ``watch`` (the dispatcher's :class:`ClaimWatch`), the claim looks for them only when the
    watch says, and goes straight to the tenants' claim while other tenants were seen
    recently; without, it looks at every claim. Returned in claim order (the aged share
    first, then by turn).

    Jobs of a paused queue (:func:`harvest.queues.pause`) are never claimed.
    """
    if limit <= 0:
        return []
    if budgets and limit <= min(budgets.values()):
        # No pool's budget can bind a claim of ``limit`` rows: the claim without budgets takes
        # the same rows, without ranking four times as many by pool (a pool with keys to
        # spare, the common case, costs a claim no more than a job without one).
        budgets = None
    # On the driver connection under ``conn``, prepared: the claim runs hundreds of times a
    # second, and SQLAlchemy's per-statement work was a third of its cost at small batches.
    # With a generic plan: Postgres otherwise planned it afresh at every run (a generic plan's
    # guess for a LIMIT it cannot see costs more), and planning was more than half its time.
    # The plan's shape does not depend on the values: every scan walks an index in order.
    starve = starvation_after if starvation_after is not None and starvation_after > 0 else 0.0
    looks = bool(starve) and (watch is None or watch.looks())
    if not budgets and not looks and (watch is None or not watch.tenants()):
        one = statements.Query(_ONE_TENANT, {"limit": limit, "ttl": ttl}, list)
        rows = statements.run_generic(conn, one)
        if not any(r.others for r in rows):
            return _claimed(rows)
        if watch is not None:
            watch.saw_tenants()
    params = _claim_params(limit, ttl, budgets, starve if looks else 0.0, weights)
    rows = statements.run_generic(conn, statements.Query(_CLAIMS_SQL[bool(budgets)], params, list))
    if looks and watch is not None:
        watch.saw(sum(1 for r in rows if r.aged), starve)
    return _claimed(rows)


def _claimed(rows: list[Any]) -> list[Claimed]:
    return [Claimed(id=r.id, token=r.lease_token, queue=r.queue, name=r.name) for r in rows]


def _claim_params(
    limit: int,
    ttl: float,
    budgets: Mapping[str, int] | None,
    starve: float,
    weights: Mapping[str, int] | None,
) -> dict[str, Any]:
    """The claim's parameters. A tenant locks at most ``:deep`` rows (``limit``, or 4 x with
    budgets) and about its weighted part of ``:spread`` (2 x ``limit``, or 4 x with budgets):
    with one tenant, ``limit`` rows, as before tenants; with many, a few rows each. ``starve``
    0: no aging share (the aged scan's ``LIMIT 0`` reads nothing)."""
    weights = weights or {}
    deep = limit * 4 if budgets else limit
    return {
        "limit": limit,
        "ttl": ttl,
        "starve": starve,
        "share": aging_share(limit) if starve else 0,
        "deep": deep,
        "spread": float(limit * 4 if budgets else limit * 2),
        "tenants": list(weights),
        "weights": [max(1, int(w)) for w in weights.values()],
        "pools": list(budgets or {}),
        "budgets": [max(0, n) for n in (budgets or {}).values()],
    }


_RECENT_RUN_SECONDS = text(
    """
    SELECT name,
           percentile_cont(0.5) WITHIN GROUP (
               ORDER BY extract(epoch FROM finished_at - started_at)) AS seconds
    FROM (SELECT name, started_at, finished_at FROM harvest_jobs
          WHERE status IN ('succeeded', 'failed', 'cancelled')
          ORDER BY finished_at DESC
          LIMIT :sample) AS recent
    WHERE started_at IS NOT NULL
    GROUP BY name
    """
).bindparams(bindparam("sample", type_=Integer, literal_execute=True))


def recent_run_seconds(conn: Connection, *, sample: int = 500) -> dict[str, float]:
    """Median run time (start to finish, database clock) of each job name among the last
    ``sample`` jobs to finish (index ``harvest_jobs_finished_idx``, read backwards).
    ``sample`` is written into the statement, not sent: a generic plan (in a
    :func:`claim_round`) that cannot see it would guess a tenth of the table and sort it."""
    rows = conn.execute(_RECENT_RUN_SECONDS, {"sample": int(sample)})
    return {r.name: float(r.seconds) for r in rows}
