"""Enqueue inside the caller's own transaction: the job exists if and only if it commits.

``app.enqueue(..., connection=c)`` and ``app.enqueue_many(..., connection=c)`` write through
``c``: a SQLAlchemy ``Connection`` or ``Session``, or a psycopg 3 ``Connection``. harvest works
in a SAVEPOINT of that transaction (a refused enqueue, e.g. QueueFull, leaves the caller's
transaction as it was) and never commits or rolls it back itself.

The dispatch nudge (which lets a due job start at once instead of at beat's next tick) goes out
only once the caller commits, and never on a rollback:

* a ``Session``: from its ``after_commit`` event (after the commit);
* a ``Connection``: from its ``commit`` event, which SQLAlchemy fires just before the DBAPI
  commit (a nudge that wins that race finds nothing, and beat's next tick runs the job);
* a psycopg connection has no commit hook: harvest sends nothing. Call ``app.nudge()`` after
  your commit for an immediate start, or let beat find the job within ``dispatch_interval``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeAlias

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from sqlalchemy import Connection, event
from sqlalchemy.orm import Session
from sqlalchemy.pool import PoolProxiedConnection

from harvest.errors import InvalidOption

if TYPE_CHECKING:
    from sqlalchemy import Engine

CallerConnection: TypeAlias = "Connection | Session | psycopg.Connection[Any]"


@contextlib.contextmanager
def joined(engine: Engine, connection: CallerConnection) -> Iterator[Session]:
    """A Session of harvest's inside the caller's transaction, in a SAVEPOINT that is released
    on success and rolled back on error. The caller's transaction stays open."""
    bind = _bind(engine, connection)
    with (
        Session(bind=bind, join_transaction_mode="create_savepoint") as session,
        session.begin(),
    ):
        yield session


def after_commit(connection: CallerConnection, action: Callable[[], None]) -> bool:
    """Call ``action`` once the caller's transaction commits (nothing on a rollback). Returns
    False when it cannot know (a psycopg connection): the caller nudges, or beat finds it."""
    if isinstance(connection, Session):
        _OnCommit.attach(connection, "after_commit", "after_transaction_end", action)
        return True
    if isinstance(connection, Connection):
        _OnCommit.attach(connection, "commit", "rollback", action)
        return True
    return False


def _bind(engine: Engine, connection: CallerConnection) -> Connection:
    """A SQLAlchemy Connection in the caller's transaction (begun, as a first statement would
    have begun it, when none is open yet)."""
    if isinstance(connection, Session):
        return connection.connection()
    if isinstance(connection, Connection):
        level = connection.get_execution_options().get("isolation_level")
        if level == "AUTOCOMMIT":
            raise InvalidOption("connection", "an AUTOCOMMIT connection has no transaction to join")
        if not connection.in_transaction():
            connection.begin()  # what its next execute() would do; the caller commits it
        return connection
    if isinstance(connection, psycopg.Connection):
        return _borrow(engine, connection)
    raise InvalidOption(
        "connection",
        "expected a SQLAlchemy Connection or Session, or a psycopg Connection, "
        f"got {type(connection).__name__}",
    )


def _borrow(engine: Engine, raw: psycopg.Connection[Any]) -> Connection:
    """A SQLAlchemy Connection over the caller's psycopg connection, that never commits, rolls
    back or closes it."""
    if raw.closed:
        raise InvalidOption("connection", "the psycopg connection is closed")
    status = raw.info.transaction_status
    if status == TransactionStatus.INERROR:
        raise InvalidOption("connection", "its transaction has failed: roll it back first")
    if raw.autocommit and status == TransactionStatus.IDLE:
        raise InvalidOption(
            "connection",
            "an autocommit psycopg connection outside `with conn.transaction():` "
            "has no transaction to join",
        )
    if engine.dialect.server_version_info is None:
        with engine.connect():  # SQLAlchemy learns the server's features on its first connect
            pass
    bind = Connection(engine, connection=_Borrowed(raw))
    bind.begin()  # SQLAlchemy's view of it; _Borrowed makes its commit and rollback no-ops
    return bind


class _Borrowed(PoolProxiedConnection):
    """The caller's psycopg connection as SQLAlchemy's pool would hand it out, except that its
    transaction and its life are the caller's: commit, rollback and close do nothing."""

    def __init__(self, raw: psycopg.Connection[Any]) -> None:
        self.dbapi_connection = raw  # type: ignore[assignment]  # psycopg's is a DBAPI connection
        self.driver_connection = raw
        self._info: dict[Any, Any] = {}

    @property
    def info(self) -> dict[Any, Any]:
        return self._info

    @property
    def record_info(self) -> dict[Any, Any] | None:
        return None

    @property
    def is_valid(self) -> bool:
        return not self.dbapi_connection.closed  # type: ignore[union-attr]

    @property
    def is_detached(self) -> bool:
        return True

    def invalidate(self, e: BaseException | None = None, soft: bool = False) -> None:
        pass

    def detach(self) -> None:
        pass

    def close(self) -> None:
        pass

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        raw: psycopg.Connection[Any] = self.dbapi_connection  # type: ignore[assignment]
        return raw.cursor(row_factory=tuple_row)  # whatever row factory the caller set

    def __getattr__(self, key: str) -> Any:
        return getattr(self.dbapi_connection, key)


class _OnCommit:
    """The actions to run on a target's next commit, dropped at the end of its transaction
    otherwise. Its two listeners are attached once per Session or Connection (they cannot be
    removed while SQLAlchemy runs them) and do nothing between transactions."""

    def __init__(self, target: Any, on_commit: str, on_end: str) -> None:
        self.actions: list[Callable[[], None]] = []
        event.listen(target, on_commit, self._committed)
        event.listen(target, on_end, self._ended)

    @classmethod
    def attach(cls, target: Any, on_commit: str, on_end: str, action: Callable[[], None]) -> None:
        hook = _HOOKS.get(target)
        if hook is None:
            hook = _HOOKS[target] = cls(target, on_commit, on_end)
        if action not in hook.actions:
            hook.actions.append(action)

    def _committed(self, *_: Any) -> None:
        actions, self.actions = self.actions, []
        for action in actions:
            action()

    def _ended(self, *args: Any) -> None:
        transaction = args[1] if len(args) > 1 else None
        if getattr(transaction, "parent", None) is None:  # the outermost one (not a SAVEPOINT)
            self.actions = []


_HOOKS: weakref.WeakKeyDictionary[Any, _OnCommit] = weakref.WeakKeyDictionary()
