"""Reading the rate-limit headers of the AI APIs (OpenAI and Anthropic style), without I/O."""

from __future__ import annotations

import httpx

from harvest.service_limits import DEFAULT_RESET, Announced, announced


def test_openai_headers() -> None:
    said = announced({
        "x-ratelimit-remaining-requests": "59", "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-remaining-tokens": "149984", "x-ratelimit-reset-tokens": "6m0.5s",
    })  # fmt: skip
    assert said == Announced(59, 1.0, 149984, 360.5)
    assert not said.exhausted
    assert said.as_args() == [59, 1_000_000, 149984, 360_500_000]


def test_durations_and_case() -> None:
    said = announced(httpx.Headers({"X-RateLimit-Remaining-Requests": "0",
                                    "X-RateLimit-Reset-Requests": "20ms"}))  # fmt: skip
    assert said == Announced(requests=0, requests_reset=0.02)
    assert said.exhausted
    assert announced({"x-ratelimit-remaining-tokens": "5", "x-ratelimit-reset-tokens": "1h2m3s"})\
        == Announced(tokens=5, tokens_reset=3723.0)  # fmt: skip
    assert announced({"x-ratelimit-remaining-requests": "3", "x-ratelimit-reset-requests": "2.5"})\
        == Announced(requests=3, requests_reset=2.5)  # fmt: skip


def test_anthropic_headers() -> None:
    said = announced({
        "anthropic-ratelimit-requests-remaining": "10",
        "anthropic-ratelimit-requests-reset": "2024-01-01T00:00:30Z",
        "anthropic-ratelimit-tokens-remaining": "0",
        "anthropic-ratelimit-tokens-reset": "2024-01-01T00:01:00+00:00",
    }, now=1704067200.0)  # fmt: skip
    assert said == Announced(10, 30.0, 0, 60.0)


def test_nothing_or_unreadable() -> None:
    assert announced({"content-type": "application/json"}) is None
    assert announced({"x-ratelimit-remaining-requests": "many"}) is None
    said = announced({"x-ratelimit-remaining-requests": "4", "x-ratelimit-reset-requests": "?"})
    assert said == Announced(requests=4, requests_reset=DEFAULT_RESET), "trusted a moment only"
    past = announced({"anthropic-ratelimit-requests-remaining": "0",
                      "anthropic-ratelimit-requests-reset": "2000-01-01T00:00:00Z"})  # fmt: skip
    assert past is not None and past.requests_reset == 0.0
