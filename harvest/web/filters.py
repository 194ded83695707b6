"""The one rule for what a page or an API call may filter by, and for the bound of a bulk action.

A filter that cannot be used is refused (:class:`~harvest.errors.InvalidFilter`, answered 422),
never dropped: a dropped filter widens a listing, and widens a bulk action to every row.

* A job name or queue filter is matched exactly as given (never trimmed). It must hold a
  character that is not whitespace, be at most :data:`NAME_MAX` characters, and be text that
  Postgres can hold (no NUL, no lone surrogate). Names longer than the 200 characters the door
  may allow today are accepted here, so that rows stored by older versions stay addressable.
* A bulk action carries ``count``, the number of rows it showed the user: it touches at most
  that many (oldest first), even if more match by the time it runs.
"""

from __future__ import annotations

from harvest.errors import InvalidFilter

BIGINT = 9_223_372_036_854_775_807
NAME_MAX = 1000  # characters of a job name or queue a filter may carry
MAX_COUNT = 2**53 - 1  # the bound of a bulk action: the largest integer JSON numbers hold exactly


def text(field: str, value: str | None) -> str | None:
    """``value`` unchanged when it is a usable exact-match filter; None stays None (no filter).

    :raises InvalidFilter: empty, only whitespace, longer than :data:`NAME_MAX` characters, or
        containing NUL or a lone surrogate.
    """
    if value is None:
        return None
    if not value.strip():
        raise InvalidFilter(field, "must not be empty or only whitespace")
    if len(value) > NAME_MAX:
        raise InvalidFilter(field, f"must be at most {NAME_MAX} characters, got {len(value)}")
    if "\x00" in value:
        raise InvalidFilter(field, "must not contain NUL")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidFilter(field, "must be valid Unicode (no lone surrogates)") from None
    return value


def job_name(value: str | None) -> str | None:
    """A job name filter (see :func:`text`)."""
    return text("name", value)


def queue(value: str | None) -> str | None:
    """A queue filter (see :func:`text`)."""
    return text("queue", value)


def usable(value: str) -> bool:
    """True when ``value`` (a stored job name) can be used as a filter."""
    try:
        text("name", value)
    except InvalidFilter:
        return False
    return True


def count(value: str | int | None) -> int:
    """The most rows a bulk action may touch: the count it showed the user.

    :raises InvalidFilter: missing, or not a whole number from 1 to :data:`MAX_COUNT`.
    """
    wrong = f"must be a whole number from 1 to {MAX_COUNT}"
    if value is None:
        raise InvalidFilter("count", "is required: the number of dead jobs shown")
    if isinstance(value, str):
        if not value.isascii() or not value.isdigit() or len(value) > 16:
            raise InvalidFilter("count", wrong)
        value = int(value)
    if isinstance(value, bool) or not 1 <= value <= MAX_COUNT:
        raise InvalidFilter("count", wrong)
    return value
