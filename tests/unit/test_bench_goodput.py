"""The goodput benchmark's token figure: what a token budget is judged by."""

from __future__ import annotations

from typing import Any

import pytest

from bench import goodput
from bench.core import judge_row


def call(start: float, tokens: int, status: int = 200) -> dict[str, object]:
    return {"start": start, "end": start + 0.5, "status": status, "tokens": tokens}


def test_tokens_are_counted_at_admission_in_the_whole_windows_after_the_first() -> None:
    log = [
        call(0.0, 40_000),  # the first window: a burst, left out
        call(60.0, 1_000),
        call(100.0, 2_000),
        call(110.0, 5_000, status=429),  # refused: not admitted
        call(119.9, 3_000),
        call(120.0, 7_000),  # in a window that is not whole
    ]
    assert goodput.steady_tokens(log, until=150.0) == pytest.approx(6_000.0)


def test_no_whole_window_after_the_first_gives_no_figure() -> None:
    assert goodput.steady_tokens([call(0.0, 100), call(70.0, 100)], until=110.0) is None
    assert goodput.steady_tokens([], until=200.0) is None


def test_harvest_async_is_judged_against_the_token_limit() -> None:
    (case,) = [c for c in goodput.FULL if c.tpm is not None]
    assert case.tpm is not None
    rows = goodput._rows(case, goodput.make_subjects(["async"], "prefork", {}))
    limit = rows[f"{case.name}: token limit"]
    (tokens,) = [r for name, r in rows.items() if name.endswith(", tokens")]
    assert limit.values == [case.keys * case.tpm]
    verdicts = []
    for share in (0.96, 0.94):
        tokens.values[:] = [share * case.keys * case.tpm]
        (judged,), _ = judge_row(tokens, list(rows.values()))
        verdicts.append((judged.baseline, round(judged.ratio or 0, 2), judged.verdict))
    assert verdicts == [(limit.subject, 0.96, "met"), (limit.subject, 0.94, "missed")]


def _figures(steady: float, limit: float) -> dict[str, object]:
    return {"steady": steady, "limit": limit, "peak_per_key": 16, "concurrency": 16,
            "http_429": 0, "lost": None, "duplicated": 0, "failed": 0, "unfinished": 0,
            "rss_mib": 100.0, "seconds": 50.0}  # fmt: skip


@pytest.mark.parametrize(("script", "bound"), [(258.0, True), (470.0, False)])
def test_the_table_says_when_the_machine_not_the_keys_bound_a_case(
    script: float, bound: bool
) -> None:
    """On a slow machine the asyncio script, which does nothing but its calls, stays far below
    the keys' limit (0.53 in the huge case on one 2-core machine): the table says so, so that a
    reader does not judge the subjects by the limit alone."""
    from bench import report

    case = next(c for c in goodput.FULL if c.name == "huge")
    rows = goodput._rows(case, goodput.make_subjects(["async", "asyncio"], "prefork", {}))
    for name, steady in ((f"{case.name}: harvest async (prefork)", 273.0),
                         (f"{case.name}: asyncio script", script)):  # fmt: skip
        rows[name].values.append(steady)
        rows[name].extra["goodput"] = _figures(steady, 489.0)
    caption = str(report.goodput_table(list(rows.values())).caption or "")
    if bound:
        assert "huge: the asyncio script reached 0.53 of the limit" in caption
        assert "not the keys, bound this run" in caption
    else:
        assert caption == ""


def _run(steady: float | None, **counts: Any) -> dict[str, Any]:
    base = {"steady": steady, "steady_span": "10th to 90th percentile of completions",
            "failed": 0, "unfinished": 0, "duplicated": 0, "http_429": 0, "errors": 0,
            "lost": 0, "peak_per_key": 4, "peak_admitted_per_key": 4, "rss_mib": 100.0,
            "seconds": 30.0}  # fmt: skip
    return base | counts


def test_runs_of_a_subject_show_the_median_rate_and_every_run_s_faults() -> None:
    runs = [
        _run(480.0, http_429=2, rss_mib=120.0),
        _run(470.0, duplicated=1, peak_per_key=5),
        _run(490.0, lost=3),
    ]
    out = goodput.combined(runs)
    assert out["steady"] == 480.0  # the median run's
    assert out["runs"] == [480.0, 470.0, 490.0]
    assert (out["http_429"], out["duplicated"], out["lost"]) == (2, 1, 3)
    assert (out["peak_per_key"], out["rss_mib"]) == (5, 120.0)


def test_a_run_that_did_not_drain_leaves_lost_unknown_and_ranks_lowest() -> None:
    runs = [_run(480.0), _run(None, lost=None, unfinished=40), _run(470.0)]
    out = goodput.combined(runs)
    assert out["steady"] == 470.0  # lower median of (None, 470, 480)
    assert out["lost"] is None
    assert out["unfinished"] == 40


def test_one_run_is_its_own_run() -> None:
    only = _run(480.0)
    assert goodput.combined([only]) is only


def test_key_slots_say_how_busy_the_keys_were_and_how_long_a_freed_slot_stood_idle() -> None:
    """One key of two slots: both calls end at 1.0; the next calls start 10 ms and 50 ms
    later. The key was back at its concurrency 50 ms after it fell from it; of the 4 slot-
    seconds in [0, 2], the calls held 3.94."""
    log = [
        {"key": "k", "start": 0.0, "end": 1.0},
        {"key": "k", "start": 0.0, "end": 1.0},
        {"key": "k", "start": 1.01, "end": 2.0},
        {"key": "k", "start": 1.05, "end": 2.0},
    ]
    slots = goodput.key_slots(log, 2, 0.0, 2.0)
    assert slots is not None
    assert slots.busy == pytest.approx(3.94 / 4)
    assert slots.idle_p50 == pytest.approx(0.05) and slots.idle_p90 == pytest.approx(0.05)
    assert slots.refills == 1
    assert goodput.key_slots(log, 2, 2.0, 2.0) is None  # no span
