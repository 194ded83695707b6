"""Engines, sessions, and the race-safe get-or-create.

Driver errors become :class:`harvest.errors.ServiceUnavailable` at one boundary
(:func:`translate_errors`), with passwords redacted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, select
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from harvest.errors import GetOrCreateConflict, ServiceUnavailable
from harvest.redact import redact_text
from harvest.settings import Settings

T = TypeVar("T")


def make_engine(settings: Settings, *, pool_size: int | None = None) -> Engine:
    """An engine sized for one process (a prefork child holds a couple of connections).

    Every connection gets the configured ``statement_timeout`` and
    ``idle_in_transaction_session_timeout`` so no session can hold row locks forever.
    """
    options = (
        f"-c statement_timeout={settings.statement_timeout_ms} "
        f"-c idle_in_transaction_session_timeout={settings.idle_in_transaction_timeout_ms} "
        "-c application_name=harvest"
    )
    return create_engine(
        settings.database_url,
        pool_size=pool_size or settings.db_pool_size,
        max_overflow=settings.db_max_overflow,
        pool_pre_ping=True,
        pool_timeout=10,
        pool_recycle=1800,
        connect_args={"options": options, "connect_timeout": 5},
    )


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextlib.contextmanager
def translate_errors() -> Iterator[None]:
    """Turn "cannot reach Postgres" driver errors into one clear, redacted error."""
    try:
        yield
    except (OperationalError, InterfaceError) as exc:
        detail = redact_text(str(exc.orig) if exc.orig is not None else str(exc))
        raise ServiceUnavailable(
            "Postgres", detail.splitlines()[0] if detail else "error"
        ) from None


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
