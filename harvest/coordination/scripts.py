"""The Lua scripts, read once from ``harvest/coordination/lua`` and registered per client.

``redis.Redis.register_script`` sends EVALSHA and, on NOSCRIPT (a restarted or flushed Redis),
loads the script and retries: callers never see the difference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from importlib import resources
from typing import Any, cast

from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import NoScriptError

Arg = str | int | float
Reply = list[Any]


@cache
def source(name: str) -> str:
    """The text of ``lua/<name>.lua`` (read from the package once per process)."""
    path = resources.files("harvest.coordination").joinpath("lua", f"{name}.lua")
    return path.read_text(encoding="utf-8")


class Script:
    """One registered script bound to one client (blocking or asyncio)."""

    def __init__(self, client: Redis | AsyncRedis, name: str) -> None:
        self.name = name
        script = client.register_script(source(name))
        self.sha: str = script.sha
        self._call = cast(Callable[..., Any], script)

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Arg] = ()) -> None:
        """Queue the script on a pipeline as a bare EVALSHA. (A pipeline's own script support
        asks Redis ``SCRIPT EXISTS`` on every execute: one round trip more.) Its reply is
        :class:`redis.exceptions.NoScriptError` when Redis does not hold the script (restarted
        or flushed): run it alone then, which loads it (see :func:`pipelined`)."""
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)


class LuaScript(Script):
    """One registered script bound to one client; call it with keys and args."""

    def __call__(self, keys: Sequence[str], args: Sequence[Arg] = (), *, client: Any = None) -> Any:
        """Run the script (or, with ``client=`` a pipeline, queue it there)."""
        return self._call(keys=list(keys), args=list(args), client=client)

    def array(self, keys: Sequence[str], args: Sequence[Arg] = ()) -> Reply:
        """Run a script whose reply is an array."""
        return cast(Reply, self(keys, args))

    def integer(self, keys: Sequence[str], args: Sequence[Arg] = ()) -> int:
        """Run a script whose reply is an integer."""
        return int(self(keys, args))


class AsyncLuaScript(Script):
    """:class:`LuaScript` for an asyncio client (``redis.asyncio``): the same scripts, awaited."""

    async def __call__(
        self, keys: Sequence[str], args: Sequence[Arg] = (), *, client: Any = None
    ) -> Any:
        """Run the script (or, with ``client=`` a pipeline, queue it there)."""
        return await self._call(keys=list(keys), args=list(args), client=client)

    async def array(self, keys: Sequence[str], args: Sequence[Arg] = ()) -> Reply:
        return cast(Reply, await self(keys, args))

    async def integer(self, keys: Sequence[str], args: Sequence[Arg] = ()) -> int:
        return int(await self(keys, args))


Call = tuple[Script, Sequence[str], Sequence[Arg]]  # a script, its keys, its args


def first_error_raised(replies: list[Any]) -> list[Any]:
    """A pipeline's replies, the first error reply raised."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def pipelined(redis: Redis, calls: Sequence[Call]) -> list[Any]:
    """Several scripts in one round trip: bare EVALSHAs on one pipeline, in order, each atomic
    as alone (not a transaction). Each reply comes back in its place, an error reply as its
    exception (not raised); a script Redis did not hold (NOSCRIPT: restarted or flushed) is
    run again alone, which loads it."""
    pipe = redis.pipeline(transaction=False)
    for script, keys, args in calls:
        script.queue(pipe, keys, args)
    replies = pipe.execute(raise_on_error=False)
    return [
        cast(LuaScript, script)(keys, args) if isinstance(reply, NoScriptError) else reply
        for reply, (script, keys, args) in zip(replies, calls, strict=True)
    ]


async def apipelined(redis: AsyncRedis, calls: Sequence[Call]) -> list[Any]:
    """:func:`pipelined` for an asyncio client."""
    pipe = redis.pipeline(transaction=False)
    for script, keys, args in calls:
        script.queue(pipe, keys, args)
    replies = await pipe.execute(raise_on_error=False)
    return [
        await cast(AsyncLuaScript, script)(keys, args)
        if isinstance(reply, NoScriptError)
        else reply
        for reply, (script, keys, args) in zip(replies, calls, strict=True)
    ]


def text(value: bytes | str) -> str:
    """A bulk reply as text, whatever the client's ``decode_responses``."""
    return value.decode() if isinstance(value, bytes) else value


def micros(seconds: float) -> int:
    """Seconds (as given by callers) to whole microseconds (as kept in Redis)."""
    return round(seconds * 1_000_000)


def seconds(micros: int | float) -> float:
    """Microseconds of the Redis clock back to seconds since the epoch (or a duration)."""
    return float(micros) / 1_000_000
