"""Fallback pools: a job may name several key pools, in order of preference.

``@app.job(pool=["azure-gpt4", "openai-gpt4"])``: the first pool that can lease a key now
serves the attempt (:func:`harvest.execution.core.gate` decides, trying them in order), and
the dispatcher counts the capacity of the pools together (:func:`harvest.dispatcher.
pool_budgets`).

A job row keeps its pools in its ``pool`` column as one text, the names in order joined by
``,`` (a character no pool name may hold, see :func:`harvest.coordination.keys.check_name`).
A one-pool job's row is exactly as before, so no migration is needed and rows written by an
older version read the same. The claim groups jobs by that text as it is: jobs with the same
list of pools share one budget, the sum of their pools' capacity.
"""

from __future__ import annotations

from collections.abc import Sequence

from harvest.coordination.keys import check_name
from harvest.errors import InvalidPool
from harvest.validation import shown

SEPARATOR = ","
MAX_POOLS = 8  # a bound on the lease tries of one gate pass


def route(pool: str | Sequence[str] | None) -> str | None:
    """``pool=`` as a job row keeps it: None (no pool), one name, or several joined by ``,``.

    :param pool: a pool name, or a list (or tuple) of 1..8 distinct pool names, first choice
        first.
    :raises InvalidPool: anything else; it names what is wrong.
    """
    if pool is None:
        return None
    if isinstance(pool, str):
        return _name(pool, pool)
    if not isinstance(pool, list | tuple):
        raise InvalidPool(pool, f"must be a pool name or a list of them, got {shown(pool)}")
    if not pool:
        raise InvalidPool(pool, "the list of pools is empty: name at least one pool")
    if len(pool) > MAX_POOLS:
        raise InvalidPool(pool, f"{len(pool)} pools listed; at most {MAX_POOLS}")
    names = [_name(name, pool) for name in pool]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise InvalidPool(pool, f"pool {twice[0]!r} is listed more than once")
    return SEPARATOR.join(names)


def pools(stored: str | None) -> tuple[str, ...]:
    """The pools of a route (as :func:`route` made it), first choice first; () for None."""
    return tuple(stored.split(SEPARATOR)) if stored else ()


def _name(name: object, given: object) -> str:
    if not isinstance(name, str):
        raise InvalidPool(given, f"a pool name must be a string, got {shown(name)}")
    try:
        return check_name("pool", name)
    except ValueError as exc:
        raise InvalidPool(given, str(exc)) from None
