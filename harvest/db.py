"""Engines, sessions, and the race-safe get-or-create.

Driver errors become :class:`harvest.errors.ServiceUnavailable` at one boundary
(:func:`translate_errors`), with passwords redacted.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, select
from sqlalchemy.exc import (
    DBAPIError,
    DisconnectionError,
    IntegrityError,
    InterfaceError,
    OperationalError,
)
from sqlalchemy.orm import Session, sessionmaker

from harvest.errors import GetOrCreateConflict, ServiceUnavailable
from harvest.redact import redact_text
from harvest.settings import Settings

T = TypeVar("T")


def connect_options(settings: Settings, *, generic_plans: bool = False) -> dict[str, Any]:
    """What every harvest connection is opened with (SQLAlchemy's and the event loop's alike):
    a connect timeout, and server-side ``statement_timeout`` and
    ``idle_in_transaction_session_timeout`` so no session can hold row locks forever.

    ``generic_plans`` (an execution worker's connections): prepared statements keep one plan
    (``plan_cache_mode=force_generic_plan``). Every statement there finds its rows by primary
    key (``harvest.execution.sql``), so the generic plan is the right one, and Postgres would
    otherwise plan each run again (a generic plan's estimate for ``unnest`` of an array is ten
    rows, a custom plan's one): planning was half of those statements' cost.

    Behind a transaction-mode pooler (``database_pooler="transaction"``) a connection carries
    nothing that outlives a transaction: no startup ``options`` (PgBouncer refuses them), and no
    server-side prepared statements (``prepare_threshold=None``; PgBouncer before 1.21 would
    hand the next transaction a server that never saw them). The timeouts then come from the
    role or database (``ALTER ROLE ... SET statement_timeout``, see the README)."""
    if settings.pooled:
        return {"application_name": "harvest", "connect_timeout": 5, "prepare_threshold": None}
    options = (
        f"-c statement_timeout={settings.statement_timeout_ms} "
        f"-c idle_in_transaction_session_timeout={settings.idle_in_transaction_timeout_ms} "
        "-c application_name=harvest"
    )
    if generic_plans:
        options += " -c plan_cache_mode=force_generic_plan"
    return {"options": options, "connect_timeout": 5}


def make_engine(
    settings: Settings, *, pool_size: int | None = None, execution: bool = False
) -> Engine:
    """An engine sized for one process (a prefork child holds a couple of connections).
    A connection is pinged at checkout only when it has been idle (:func:`_ping_when_idle`).

    ``execution`` (an execution worker's): no ping before each checkout (a round trip, and a
    transaction, for each statement: a third of that worker's Postgres transactions), as its
    statements retry once on a fresh connection when the old one died instead; and generic
    plans (see :func:`connect_options`)."""
    engine = create_engine(
        settings.database_url,
        pool_size=pool_size or settings.db_pool_size,
        max_overflow=settings.db_max_overflow,
        pool_timeout=10,
        pool_recycle=1800,
        connect_args=connect_options(settings, generic_plans=execution),
    )
    if not execution:
        _ping_when_idle(engine)
    return engine


TRUSTED_FOR = 0.25  # seconds after its last use that a pooled connection is not pinged


def _ping_when_idle(engine: Engine) -> None:
    """Ping a pooled connection at checkout, as ``pool_pre_ping`` does, unless it came back to
    the pool less than :data:`TRUSTED_FOR` seconds ago (HikariCP's ``aliveBypassWindowMs``).
    The ping is a round trip of its own, as much as a one-statement enqueue's; a connection
    in steady use does without, and one that died in that window fails its statement, which
    the caller sees as :class:`~harvest.errors.ServiceUnavailable` (as it would had the
    connection died just after a ping), and the pool then replaces every connection. A
    failed ping makes the pool try a fresh connection, as ``pool_pre_ping``'s does."""

    def used(dbapi_connection: Any, record: Any, *_: Any) -> None:
        record.info["harvest_used_at"] = time.monotonic()

    def checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        if time.monotonic() - record.info.get("harvest_used_at", 0.0) < TRUSTED_FOR:
            return
        try:
            alive = engine.dialect.do_ping(dbapi_connection)
        except engine.dialect.loaded_dbapi.Error as exc:
            raise DisconnectionError(str(exc)) from exc
        if not alive:
            raise DisconnectionError("ping failed")

    event.listen(engine, "connect", used)
    event.listen(engine, "checkin", used)
    event.listen(engine, "checkout", checkout)


@contextlib.contextmanager
def autocommit_driver(engine: Engine) -> Iterator[Any]:
    """A pooled connection's own psycopg connection, in autocommit, for statements that each
    commit by themselves; back in the pool as it was (autocommit off) when the block ends.

    Nothing of SQLAlchemy's ``Connection`` is made around it: its isolation level set and reset,
    its transaction bookkeeping and its events cost as much as the pool's checkout itself. A
    one-statement enqueue, measured in one process against a raw INSERT of the same row: 1,240
    µs through a ``Connection``, 1,010 µs so, 770 µs for the statement alone on a connection of
    its own.

    A driver error comes out as SQLAlchemy's (``DBAPIError.instance``, parameters hidden), as
    it would through a ``Connection``, so :func:`translate_errors` and callers see the same
    classes. A connection the error left unusable is invalidated with the pool's generation, as
    a ``Connection`` does on a disconnect (every connection made before it is replaced at its
    next checkout), instead of being put back."""
    dbapi = engine.dialect.loaded_dbapi
    fairy = engine.raw_connection()
    driver: Any = fairy.driver_connection
    try:
        driver.autocommit = True
        yield driver
    except dbapi.Error as exc:
        if engine.dialect.is_disconnect(exc, driver, None):  # closed or broken
            engine.pool._invalidate(fairy, exc)  # what Connection does on a disconnect
        raise DBAPIError.instance(
            None, None, exc, dbapi.Error, hide_parameters=True, dialect=engine.dialect
        ) from exc
    finally:
        if fairy.is_valid:
            try:
                driver.autocommit = False
            except dbapi.Error as exc:  # not idle (a statement cut short): not to be reused
                fairy.invalidate(exc)
        fairy.close()


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Turn "cannot reach Postgres" driver errors into one clear, redacted error."""
    try:
        yield
    except (OperationalError, InterfaceError) as exc:
        raise unavailable(exc) from None


def unavailable(exc: OperationalError | InterfaceError) -> ServiceUnavailable:
    """The one clear, redacted error for a "cannot reach Postgres" driver error."""
    detail = redact_text(str(exc.orig) if exc.orig is not None else str(exc))
    return ServiceUnavailable("Postgres", detail.splitlines()[0] if detail else "error")


def get_or_create(
    session: Session,
    model: type[T],
    *,
    lookup: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
    retries: int = 5,
    on_create: Callable[[T], None] | None = None,
) -> tuple[T, bool]:
    """Return ``(row, created)`` for the row matching ``lookup``, creating it if missing.

    Safe under any number of concurrent callers, given a unique constraint over ``lookup``:
    the INSERT runs inside a SAVEPOINT; on IntegrityError the savepoint is rolled back (the outer
    transaction survives) and the winner's row is re-read. If the winner's row vanished in
    between (deleted), try again, at most ``retries`` times.
    """
    query = select(model).filter_by(**lookup)
    for _ in range(retries):
        found = session.scalars(query).one_or_none()
        if found is not None:
            return found, False
        row = model(**{**lookup, **(defaults or {})})
        try:
            with session.begin_nested():
                session.add(row)
                session.flush()
        except IntegrityError:
            continue
        if on_create is not None:
            on_create(row)
        return row, True
    raise GetOrCreateConflict(
        f"get_or_create on {getattr(model, '__tablename__', model)} collided {retries} times"
    )
