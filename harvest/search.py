"""Searching jobs: what a person types in the dashboard's search box, ``/api/jobs?q=`` or
``harvest jobs ls --search``, read into a :class:`Search` (pure: no I/O).

The forms (one a search):

* ``42`` or ``#42`` or ``id = 42``: the job with that id;
* ``name = fetch_page``: jobs of exactly that name; any other text without ``=``: jobs whose
  name contains it (case-insensitive);
* ``payload.url = https://example.org/a`` (a dotted path into the payload): jobs whose payload
  holds that value there. The value is read as JSON when it is JSON (``5``, ``true``,
  ``"5"``, ``null``), as text otherwise. It is matched by containment (``payload @> …``, the
  GIN index ``harvest_jobs_payload_idx``): an object value matches an object holding at least
  its keys, an array value (``payload.tags = ["news"]``) an array holding its elements.

Anything else is refused with :class:`InvalidSearch` (the dashboard answers 422); the search
reaches SQL only as bound parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from harvest.errors import InvalidFilter

MAX_LENGTH = 1000  # characters of a search
MAX_PATH = 32  # keys in a payload path
BIGINT = 9_223_372_036_854_775_807
FORMS = "search by id (42), name (name = x, or part of one) or payload.<path> = value"


class InvalidSearch(InvalidFilter):
    """A search that cannot be read (``field`` is ``q``); the message says which form to use."""

    def __init__(self, reason: str) -> None:
        super().__init__("q", f"{reason} ({FORMS})")


@dataclass(frozen=True, slots=True)
class Search:
    """One search; exactly one field is set."""

    job_id: int | None = None
    name: str | None = None  # exact
    name_part: str | None = None  # contained in the name, case-insensitive
    payload: str | None = None  # a JSON object the payload must contain

    @property
    def like(self) -> str | None:
        """``name_part`` as an ILIKE pattern (its ``%``, ``_`` and ``\\`` escaped)."""
        if self.name_part is None:
            return None
        escaped = self.name_part.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        return f"%{escaped}%"


def parse(text: str) -> Search:
    """Read a search (see the module's doc); raises :class:`InvalidSearch`."""
    query = _checked(text)
    if "=" not in query:
        bare = query.removeprefix("#")
        if bare.isascii() and bare.isdigit():
            return Search(job_id=_job_id(bare))
        return Search(name_part=query)
    field, _, value = (part.strip() for part in query.partition("="))
    if not value:
        raise InvalidSearch(f"{field or 'the field'} = needs a value after '='")
    if field == "id":
        return Search(job_id=_job_id(value))
    if field == "name":
        return Search(name=_text(value))
    if field == "payload" or field.startswith("payload."):
        return Search(payload=_containment(field.split(".")[1:], value))
    raise InvalidSearch(f"unknown field {field[:40]!r}")


def _checked(text: Any) -> str:
    if not isinstance(text, str) or not text.strip():
        raise InvalidSearch("the search is empty")
    if len(text) > MAX_LENGTH:
        raise InvalidSearch(f"the search is {len(text)} characters, over {MAX_LENGTH}")
    if "\x00" in text:
        raise InvalidSearch("the search contains NUL")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidSearch("the search is not valid Unicode (a lone surrogate)") from None
    return text.strip()


def _job_id(value: str) -> int:
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= BIGINT:
        raise InvalidSearch(f"id must be a whole number from 1 to {BIGINT}")
    return int(value)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json(value: str) -> str:
    """``value`` as JSON text: itself when it is JSON (checked, NaN refused), else a string."""
    try:
        json.loads(value, parse_float=Decimal, parse_constant=_no_constant)
    except ValueError:
        return json.dumps(value, ensure_ascii=False)
    except RecursionError:
        raise InvalidSearch("the value nests too deep") from None
    return value


def _text(value: str) -> str:
    """A name given plainly or as a JSON string (``"a name"``)."""
    if value.startswith('"'):
        try:
            loaded = json.loads(value)
        except ValueError:
            raise InvalidSearch("a quoted name must be a JSON string") from None
        if isinstance(loaded, str) and loaded:
            return loaded
        raise InvalidSearch("a quoted name must be a JSON string")
    return value


def _containment(path: list[str], value: str) -> str:
    """The JSON object ``{"a": {"b": value}}`` for path ``[a, b]``."""
    if not path:
        raise InvalidSearch("name a key of the payload: payload.<key> = value")
    if len(path) > MAX_PATH:
        raise InvalidSearch(f"the payload path has {len(path)} keys, over {MAX_PATH}")
    if any(not key.strip() for key in path):
        raise InvalidSearch("the payload path has an empty key (payload.a.b = value)")
    found = _json(value)
    for key in reversed(path):
        found = f"{{{json.dumps(key.strip(), ensure_ascii=False)}: {found}}}"
    return found
