"""Running a message's jobs in this process, to the end: what the Celery task does, without
Celery (tests, ``harvest.testing``). The work is done by :mod:`harvest.execution`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from harvest.execution.core import DUPLICATES, LOST, MALFORMED
from harvest.execution.executor import Executor
from harvest.execution.messages import parse_message

if TYPE_CHECKING:
    from harvest.app import Harvest

__all__ = ["DUPLICATES", "LOST", "MALFORMED", "Runner", "parse_message"]


class Runner(Executor):
    """An :class:`~harvest.execution.executor.Executor` whose ``execute`` waits for every job of
    the message, sync or async, to end. Call :meth:`close` when done."""

    def __init__(self, app: Harvest, **options: Any) -> None:
        super().__init__(app, **options)

    def execute(self, body: Any, *, wait: bool = True) -> dict[str, int]:
        counts = super().execute(body, wait=wait)
        counts.pop("accepted", None)
        return counts

    def close(self) -> None:
        self.shutdown(grace=0.0)
