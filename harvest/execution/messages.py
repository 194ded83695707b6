"""Execution messages: what the dispatcher sends a worker, read and checked in one place."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from harvest.execution import sql


@dataclass(frozen=True, slots=True)
class Item:
    """One job of an execution message."""

    job_id: int
    token: uuid.UUID
    name: str | None = None  # absent in messages of an older dispatcher

    @property
    def pair(self) -> sql.Pair:
        return (self.job_id, self.token)


def parse_message(body: Any) -> list[Item]:
    """``[[job_id, token, name], ...]`` (or ``[job_id, token]``) -> items. Anything else is
    refused as a whole."""
    if not isinstance(body, list) or not body:
        raise ValueError("execution message must be a non-empty list of [job_id, token, name]")
    items = []
    for item in body:
        if (
            not isinstance(item, list)
            or len(item) not in (2, 3)
            or isinstance(item[0], bool)
            or not isinstance(item[0], int)
            or not isinstance(item[1], str)
            or (len(item) == 3 and not isinstance(item[2], str))
        ):
            raise ValueError("execution message items must be [job_id, token, name]")
        items.append(Item(item[0], uuid.UUID(item[1]), item[2] if len(item) == 3 else None))
    return items
