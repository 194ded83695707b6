"""Calls made in one turn of an event loop, gathered and sent to Redis together.

Many async jobs of one process start and end within the same turn of its loop (a message's
jobs arrive together; no-op or short calls end together). Each of their key lease tries and
releases is a Redis script: alone, each pays its own round trip and its share of the client's
per-command work. :class:`PerTurn` gathers what is asked in one turn under one key (a pool, a
pool and a cost) and sends it as one call: each caller still gets its own answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
I = TypeVar("I")  # noqa: E741 (an item of a call)
R = TypeVar("R")

Pending = list[tuple[I, "asyncio.Future[R]"]]


class PerTurn(Generic[K, I, R]):
    """``await per_turn(key, item)``: the items asked under ``key`` in one turn of the running
    loop go to ``send(key, items)`` together (at most ``most`` a call), which returns a result
    for each, in order. A caller that stopped waiting (cancelled) gets nothing: its result goes
    to ``unclaimed`` (a lease to give back), once every waiting caller has its answer. A failed
    call fails each of its callers with its exception."""

    def __init__(
        self,
        send: Callable[[K, list[I]], Awaitable[list[R]]],
        most: int,
        unclaimed: Callable[[R], Awaitable[None]] | None = None,
    ) -> None:
        self._send, self._most, self._unclaimed = send, most, unclaimed
        self._pending: dict[K, Pending[I, R]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def __call__(self, key: K, item: I) -> R:
        loop = asyncio.get_running_loop()
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = []
            task = loop.create_task(self._flush(key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        future: asyncio.Future[R] = loop.create_future()
        pending.append((item, future))
        return await future

    async def _flush(self, key: K) -> None:
        await asyncio.sleep(0)  # a turn of the loop: what is asked in it joins
        pending = self._pending.pop(key)
        for start in range(0, len(pending), self._most):
            await self._send_part(key, pending[start : start + self._most])

    async def _send_part(self, key: K, pending: Pending[I, R]) -> None:
        try:
            results = await self._send(key, [item for item, _ in pending])
        except Exception as exc:
            for _, future in pending:
                if not future.done():
                    future.set_exception(exc)
            return
        unclaimed: list[R] = []
        for (_, future), result in zip(pending, results, strict=True):
            if not future.done():
                future.set_result(result)
            else:
                unclaimed.append(result)
        if self._unclaimed is not None:
            for result in unclaimed:
                await self._unclaimed(result)
