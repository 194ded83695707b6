"""What a service says about a key's limits in its response headers, read without I/O.

AI APIs announce what is left of a key's limits on every answer. OpenAI (and the many services
that copy it, the loopback one among them) send ``x-ratelimit-remaining-requests`` and
``x-ratelimit-reset-requests`` (a duration: ``1s``, ``6m0s``, ``20ms``, ``1.5s``), and the same
two for ``-tokens``; Anthropic sends ``anthropic-ratelimit-requests-remaining`` and
``anthropic-ratelimit-requests-reset`` (an RFC 3339 time), and the same for ``-tokens``. LiteLLM
maps the Anthropic names onto the OpenAI ones (``process_anthropic_headers``); so does
:func:`announced`. A handler passes the response to ``ctx.observe(response)``; the key's live
state in Redis then follows what the service said (see ``pool_release.lua``).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

DEFAULT_RESET = 1.0  # seconds an announcement without a readable reset is trusted
MAX_RESET = 86_400.0
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_PREFIXES = ("x-ratelimit-{what}-{dim}", "anthropic-ratelimit-{dim}-{what}")


@dataclass(frozen=True, slots=True)
class Announced:
    """Requests and tokens a key has left, and seconds until each is reset (None: not said)."""

    requests: int | None = None
    requests_reset: float = 0.0
    tokens: int | None = None
    tokens_reset: float = 0.0

    @property
    def exhausted(self) -> bool:
        """The service said nothing is left (of requests or of tokens)."""
        return self.requests == 0 or self.tokens == 0

    def as_args(self) -> list[int]:
        """The four values ``pool_release.lua`` takes: left and reset (us) each, -1: not said."""
        return [
            -1 if self.requests is None else self.requests,
            round(self.requests_reset * 1_000_000),
            -1 if self.tokens is None else self.tokens,
            round(self.tokens_reset * 1_000_000),
        ]


NOTHING = [-1, 0, -1, 0]  # as_args() of no announcement


def announced(headers: Mapping[str, Any], *, now: float | None = None) -> Announced | None:
    """The rate-limit state in ``headers`` (any mapping; names in any case), or None when they
    carry none. ``now``: the wall clock, for Anthropic's reset times (default: now)."""
    lower = {str(k).lower(): str(v) for k, v in headers.items()}
    wall = time.time() if now is None else now
    requests, requests_reset = _dimension(lower, "requests", wall)
    tokens, tokens_reset = _dimension(lower, "tokens", wall)
    if requests is None and tokens is None:
        return None
    return Announced(requests, requests_reset, tokens, tokens_reset)


def _dimension(headers: dict[str, str], dim: str, now: float) -> tuple[int | None, float]:
    for pattern in _PREFIXES:
        left = _whole(headers.get(pattern.format(what="remaining", dim=dim)))
        if left is not None:
            reset = _reset(headers.get(pattern.format(what="reset", dim=dim)), now)
            return left, DEFAULT_RESET if reset is None else reset
    return None, 0.0


def _whole(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        number = float(value.strip())
    except ValueError:
        return None
    return max(int(number), 0) if math.isfinite(number) else None


def _reset(value: str | None, now: float) -> float | None:
    """Seconds from now: a duration (``1m30s``, ``250ms``, ``2``) or an RFC 3339 time."""
    if value is None or not (text := value.strip()):
        return None
    try:
        return _clamp(float(text))
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if parts and "".join(n + u for n, u in parts) == text:
        scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
        return _clamp(sum(float(n) * scale[u] for n, u in parts))
    try:
        return _clamp(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() - now)
    except ValueError:
        return None


def _clamp(seconds: float) -> float | None:
    if math.isnan(seconds):
        return None
    return min(max(seconds, 0.0), MAX_RESET)
