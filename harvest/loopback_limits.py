"""The loopback service's keys and their limits, pure (no I/O, the clock is an argument): a
key's concurrency, request rate and token budget, the rate-limit headers it answers with, and
the oracle that reads per-window token counts back from the call log (see
:mod:`harvest.loopback`)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SIGMA = 0.3


@dataclass(frozen=True, slots=True)
class LoopKey:
    """A key the service knows: its secret and the limits it enforces on it."""

    name: str
    secret: str
    concurrency: int
    rate: int | None = None  # calls admitted per ``period`` seconds; None: no rate limit
    period: float = 60.0
    tpm: int | None = None  # tokens admitted per ``token_period`` seconds; None: no budget
    token_period: float = 60.0
    # the limits the service really enforces when lower than the ones above (which are what
    # its users were told, and declare to harvest); None: as declared. Concurrency is never
    # announced in headers; a true rate is (x-ratelimit-limit-requests tells the truth).
    true_concurrency: int | None = None
    true_rate: int | None = None

    @property
    def max_in_flight(self) -> int:
        return self.concurrency if self.true_concurrency is None else self.true_concurrency

    @property
    def enforced_rate(self) -> int | None:
        return self.rate if self.true_rate is None else self.true_rate

    def public(self) -> dict[str, Any]:
        return {"name": self.name, "concurrency": self.concurrency, "rate": self.rate,
                "period": self.period, "tpm": self.tpm, "token_period": self.token_period,
                "true_concurrency": self.true_concurrency,
                "true_rate": self.true_rate}  # fmt: skip


# --- the limits (pure: no I/O, the clock is an argument) --------------------------------------


@dataclass
class KeyState:
    """One key's live use: what is in flight, what its window holds, and its counters."""

    key: LoopKey
    ends: list[float] = field(default_factory=list)  # planned ends of admitted calls in flight
    window: deque[float] = field(default_factory=deque)  # admission times within the period
    counts: dict[str, int] = field(default_factory=dict)
    spent: deque[tuple[float, int]] = field(default_factory=deque)  # (admitted at, tokens)
    spent_total: int = 0  # the tokens in ``spent``

    def admit(self, now: float, latency: float, tokens: int = 0) -> float | None:
        """Admit a call taking ``latency`` and using ``tokens`` (None), or the seconds until
        one could be."""
        key, window = self.key, self.window
        while window and window[0] <= now - key.period:
            window.popleft()
        self._slide_tokens(now)
        self._peak("peak_attempted", len(self.ends) + 1)
        self._peak("peak_window_tokens_attempted", self.spent_total + tokens)
        waits = []
        if key.tpm is not None and self.spent_total + tokens > key.tpm:
            waits.append(self._token_wait(now, tokens))
            self.count("http_429_tokens")
        if len(self.ends) >= key.max_in_flight:
            waits.append(min(self.ends) - now)
            self.count("http_429_concurrency")
        rate = key.enforced_rate
        if rate is not None and len(window) >= rate:
            waits.append(window[len(window) - rate] + key.period - now)
            self.count("http_429_rate")
        if waits:
            self.count("http_429")
            return max(0.001, *waits)
        window.append(now)
        self.ends.append(now + latency)
        self._peak("peak_in_flight", len(self.ends))
        if key.tpm is not None:
            self.spent.append((now, tokens))
            self.spent_total += tokens
        self._peak("peak_window_tokens", self.spent_total)
        return None

    def _slide_tokens(self, now: float) -> None:
        while self.spent and self.spent[0][0] <= now - self.key.token_period:
            self.spent_total -= self.spent.popleft()[1]

    def _token_wait(self, now: float, tokens: int) -> float:
        """Seconds until ``tokens`` more fit in the window (forever: a day)."""
        assert self.key.tpm is not None
        left = self.spent_total
        for at, n in self.spent:
            left -= n
            if left + tokens <= self.key.tpm:
                return at + self.key.token_period - now
        return 86_400.0

    def headers(self, now: float) -> dict[str, str]:
        """The rate-limit headers of the AI APIs, for this key now."""
        key, out, rate = self.key, dict[str, str](), self.key.enforced_rate
        if rate is not None:
            used = sum(1 for t in self.window if t > now - key.period)
            reset = self.window[0] + key.period - now if self.window else 0.0
            out |= {"x-ratelimit-limit-requests": str(rate),
                    "x-ratelimit-remaining-requests": str(max(rate - used, 0)),
                    "x-ratelimit-reset-requests": f"{max(reset, 0.0):.3f}s"}  # fmt: skip
        if key.tpm is not None:
            self._slide_tokens(now)
            reset = self.spent[0][0] + key.token_period - now if self.spent else 0.0
            out |= {"x-ratelimit-limit-tokens": str(key.tpm),
                    "x-ratelimit-remaining-tokens": str(max(key.tpm - self.spent_total, 0)),
                    "x-ratelimit-reset-tokens": f"{max(reset, 0.0):.3f}s"}  # fmt: skip
        return out

    def release(self, planned_end: float) -> None:
        self.ends.remove(planned_end)

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def _peak(self, name: str, value: int) -> None:
        self.counts[name] = max(self.counts.get(name, 0), value)

    def reset(self) -> None:
        self.counts = {"peak_in_flight": len(self.ends), "peak_attempted": len(self.ends)}

    def stats(self) -> dict[str, Any]:
        names = ("requests", "ok", "http_429", "http_429_rate", "http_429_concurrency",
                 "http_429_tokens", "http_500", "tokens", "peak_in_flight", "peak_attempted",
                 "peak_window_tokens", "peak_window_tokens_attempted")  # fmt: skip
        return {**self.key.public(), "in_flight": len(self.ends),
                **{n: self.counts.get(n, 0) for n in names}}  # fmt: skip


def window_peaks(log: Sequence[dict[str, Any]], period: float = 60.0) -> dict[str, int]:
    """Per key, the most tokens admitted (answered 200 or 500) in any window of ``period``
    seconds, from the call log: the oracle that no key went over its budget."""
    by_key: dict[str, list[tuple[float, int]]] = {}
    for e in log:
        if e["status"] in (200, 500):
            by_key.setdefault(e["key"], []).append((e["start"], int(e["tokens"])))
    peaks: dict[str, int] = {}
    for key, calls in by_key.items():
        calls.sort()
        total, first, peak = 0, 0, 0
        for at, n in calls:
            total += n
            while calls[first][0] <= at - period:
                total -= calls[first][1]
                first += 1
            peak = max(peak, total)
        peaks[key] = peak
    return peaks


def mean_latency(median: float, sigma: float = SIGMA) -> float:
    """The mean of a lognormal latency with this median and shape."""
    return median * math.exp(sigma * sigma / 2)
