"""Retry policy: pure functions, no I/O, unit-tested on their own."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter.

    The n-th retry (``attempt`` = the attempt that just failed, from 1) waits
    ``min(max_delay, base * factor ** (attempt - 1))`` seconds, spread by ``±jitter``
    (a fraction) so that jobs that failed together do not retry together.
    """

    base: float = 1.0
    factor: float = 2.0
    max_delay: float = 600.0
    jitter: float = 0.25

    def __post_init__(self) -> None:
        if not all(math.isfinite(v) for v in (self.base, self.factor, self.max_delay, self.jitter)):
            raise ValueError("retry parameters must be finite numbers")
        if self.base < 0 or self.max_delay < 0:
            raise ValueError("retry delays must not be negative")
        if self.factor < 1:
            raise ValueError("retry factor must be at least 1")
        if not 0 <= self.jitter < 1:
            raise ValueError("retry jitter must be in [0, 1)")

    def nominal(self, attempt: int) -> float:
        """The delay before the retry that follows failed attempt ``attempt``, without jitter."""
        if attempt < 1:
            raise ValueError("attempt counts from 1")
        exponent = min(attempt - 1, 64)  # 2**64 seconds is already past any max_delay
        try:
            return min(self.max_delay, self.base * self.factor**exponent)
        except OverflowError:
            return self.max_delay

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        nominal = self.nominal(attempt)
        spread = (rng or random).uniform(-self.jitter, self.jitter)
        return max(0.0, min(self.max_delay, nominal * (1 + spread)))


def should_retry(attempt: int, max_attempts: int) -> bool:
    """True while attempts remain: attempt ``attempt`` (from 1) just failed."""
    return attempt < max_attempts
