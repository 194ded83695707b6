"""Scenario ``goodput``: jobs/s through a pool of rate-limited keys, as a fraction of what the
keys physically allow, for harvest and for what a user would write instead, in one run.

Each case is a set of keys on the loopback AI-API service (:mod:`harvest.loopback`): K keys,
each at most C calls at once and R calls in any sliding window of 60 s, latency lognormal with
median L and sigma 0.3, whose mean is L̄ = 1.046 L. The physical limit of the keys is
min(K·R/60, K·C/L̄) jobs/s; with a token budget of T tokens per minute a key and calls of T̄
tokens on average, K·T/60/T̄ as well (the ``token-bound`` case: calls reserve the most they may
use, ``max_tokens``, and report what they used). Every subject (:mod:`bench.goodput_subjects`)
gets a fresh service (seeded: a call's latency is its job's item's own, the same for every
subject; :mod:`harvest.loopback`) and N jobs that each make one call, and runs until they are
all done or its time cap passes (then it is stopped: the jobs not done are reported as
unfinished). Everything is read from the service's own records, the oracle: its per-key peaks
and 429 counts, and the log of every call (with a token budget, the most tokens a key had in
any window of 60 s).

- **jobs/s steady.** Jobs whose (first) successful call ended in the steady part, per second.
  Rate-bound cases (K·R/60 < K·C/L̄): a key's first window is a burst (its R calls go out at
  the key's concurrency), so the steady part is the whole windows of 60 s after the first,
  counted from the subject's first call (N covers two windows and a little more). Other cases:
  from the 10th to the 90th percentile of the completion times, which leaves out the ramp-up
  and the drain.
- **lost**: jobs the subject has finished by its own account (its queue is empty) without a
  successful call or a failure of its own to show for them; measured only when it drained.
  **duplicated**: jobs whose call succeeded more than once. **unfinished**: not done at the cap.
- **peak/C**: the most calls a key was asked to hold at once (its admitted calls in flight plus
  the one arriving, refused or not) against C. **RSS**: sum over the subject's processes
  (every worker, their children, beat), the peak of samples each second.

A full run is about 30 minutes; one run per subject by default (the rate-bound case alone takes
two minutes a subject). ``--goodput-reps N`` runs each subject N times, the subjects taking
turns (so a slower minute of the machine falls on all of them): jobs/s is the median run's,
429s, lost, duplicated, failed and unfinished jobs are summed over the runs, peaks and RSS the
highest, and each run's call log is kept (``-1``, ``-2``, ... in its name). ``--quick`` runs
the rate-bound case with a window of 10 s (20 calls per 10 s a key: the same 16 jobs/s) and the
concurrency-bound case, small.
"""

from __future__ import annotations

import csv
import math
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.core import Comparison, Row, Target, percentile
from bench.env import Ctx
from bench.goodput_subjects import SUBJECTS, Case, Subject, make_subjects
from harvest.loopback import (
    LOG_FIELDS,
    SIGMA,
    LoopbackHandle,
    mean_latency,
    start_loopback,
    window_peaks,
)

SEED = 2026  # every subject's calls take the same latencies, item by item (harvest.loopback)
FULL = (
    Case("rate-bound", 8, 4, 120, 60.0, 0.5, jobs=2016, cap=150.0),
    Case("concurrency-bound", 8, 4, 6000, 60.0, 1.0, jobs=920, cap=50.0),
    Case("large", 32, 8, 6000, 60.0, 2.0, jobs=3680, cap=50.0),
    Case("huge", 64, 16, 6000, 60.0, 2.0, jobs=14700, cap=50.0),
    Case("token-bound", 8, 4, 6000, 60.0, 0.5, jobs=640, cap=180.0, tpm=40_000, tokens=(200, 2000)),
    Case("learned", 8, 4, 6000, 60.0, 1.0, jobs=1600, cap=180.0, true_concurrency=2),
)
WARMUP = 30.0  # seconds the ``learned`` case allows for finding the keys' true limit
QUICK = (
    Case("rate-bound", 8, 4, 20, 10.0, 0.5, jobs=340, cap=25.0),
    Case("concurrency-bound", 8, 4, 6000, 60.0, 1.0, jobs=310, cap=15.0),
)
POLL = 1.0
MIB = 1024 * 1024


def _limits(case: Case) -> tuple[float, float]:
    """(K·R/period, K·C/mean latency), jobs/s; with a token budget, K·T/60/mean tokens counts
    as a rate (whichever is lower)."""
    mean = mean_latency(case.latency, SIGMA)
    by_rate = case.keys * case.rate / case.period
    if case.tpm is not None and case.mean_tokens:
        by_rate = min(by_rate, case.keys * case.tpm / 60.0 / case.mean_tokens)
    return by_rate, case.keys * case.real_concurrency / mean


def limit(case: Case) -> float:
    """The physical limit of the keys: min(K·R/period, K·T/60/T̄, K·C/mean latency), jobs/s."""
    return min(_limits(case))


def rate_bound(case: Case) -> bool:
    """Bound by a window (requests or tokens per period), not by concurrency."""
    by_rate, by_concurrency = _limits(case)
    return by_rate < by_concurrency


def window(case: Case) -> float:
    """The window of the limit that binds: a minute for tokens, else the rate's period."""
    by_tokens = case.keys * case.tpm / 60.0 / case.mean_tokens if case.tpm and case.tokens else None
    if by_tokens is not None and by_tokens < case.keys * case.rate / case.period:
        return 60.0
    return case.period


# --- what the service saw (pure) --------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    steady: float | None  # jobs/s
    steady_span: str  # how the steady part was taken
    done: int
    duplicated: int
    http_429: int
    errors: int  # answers other than 200 and 429
    first_call: float | None
    last_done: float | None
    slots: Slots | None = None  # concurrency-bound cases: how busy the keys were kept


@dataclass(frozen=True)
class Slots:
    """How busy a subject kept the keys' K·C call slots over the steady part, from the
    service's log: ``busy`` is the share of slot time a call held (1.0: every key at C all
    along), and ``idle_p50``/``idle_p90`` (seconds) how long a key that was at C stayed below
    it before a call filled it again (from the end that freed a slot to the start that took
    it back): what a subject loses between one call and the next on a key, the time its own
    turn-around (releasing, handing over, starting the next call) costs. Not for a rate-bound
    case, whose keys idle by design."""

    busy: float
    idle_p50: float
    idle_p90: float
    refills: int  # slot refills counted for the idle times


def analyse(log: list[dict[str, Any]], case: Case, until: float) -> Figures:
    """Figures of one subject's run from the service's call log; ``until`` is the wall-clock
    end of the run (the cap, or the last completion when it drained)."""
    ok = [e for e in log if e["status"] == 200]
    counts = Counter(e["job"] for e in ok)
    first_end: dict[Any, float] = {}
    for e in sorted(ok, key=lambda e: e["end"]):
        first_end.setdefault(e["job"], e["end"])
    ends = sorted(first_end.values())
    first = min((e["start"] for e in log), default=None)
    steady, span = _steady(ends, case, first, until)
    slots = None
    if not rate_bound(case) and len(ends) >= 10:
        slots = key_slots(log, case.real_concurrency, percentile(ends, 10), percentile(ends, 90))
    return Figures(
        steady=steady,
        steady_span=span,
        done=len(counts),
        duplicated=sum(1 for c in counts.values() if c > 1),
        http_429=sum(1 for e in log if e["status"] == 429),
        errors=sum(1 for e in log if e["status"] not in (200, 429)),
        first_call=first,
        last_done=ends[-1] if ends else None,
        slots=slots,
    )


def key_slots(log: list[dict[str, Any]], concurrency: int, lo: float, hi: float) -> Slots | None:
    """:class:`Slots` of the calls in ``log`` over [``lo``, ``hi``], keys of ``concurrency``
    calls at once (429s included: a call the service refused still held a request)."""
    if hi <= lo:
        return None
    calls: dict[Any, list[tuple[float, float]]] = {}
    for e in log:
        calls.setdefault(e["key"], []).append((e["start"], e["end"]))
    held, idle = 0.0, []
    for spans in calls.values():
        held += sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in spans)
        events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
        in_flight, freed_at = 0, None
        for t, step in events:  # an end sorts before a start at the same moment
            if step > 0:
                if in_flight == concurrency - 1 and freed_at is not None and lo <= t <= hi:
                    idle.append(t - freed_at)
                freed_at = None if in_flight + 1 == concurrency else freed_at
            elif in_flight == concurrency:
                freed_at = t
            in_flight += step
    if not idle or not calls:
        return None
    idle.sort()
    busy = held / (len(calls) * concurrency * (hi - lo))
    return Slots(busy, percentile(idle, 50), percentile(idle, 90), len(idle))


def steady_windows(first: float, until: float, period: float) -> tuple[float, float] | None:
    """The steady part of a window-bound run: the whole windows of ``period`` after the first
    (a burst), from the first call to ``until``; None when there is not one."""
    windows = math.floor((until - first) / period) - 1
    if windows < 1:
        return None
    return first + period, first + period * (1 + windows)


def _steady(
    ends: list[float], case: Case, first: float | None, until: float
) -> tuple[float | None, str]:
    if first is None or len(ends) < 10:
        return None, "too few jobs done"
    if rate_bound(case):
        period = window(case)
        span = steady_windows(first, until, period)
        if span is not None:
            lo, hi = span
            count = sum(1 for t in ends if lo <= t < hi)
            windows = round((hi - lo) / period)
            return count / (hi - lo), f"{windows} whole window(s) of {period:g} s after the first"
    lo, hi = percentile(ends, 10), percentile(ends, 90)
    if hi <= lo:
        return None, "no spread"
    count = sum(1 for t in ends if lo < t <= hi)
    return count / (hi - lo), "10th to 90th percentile of completions"


# --- running a subject ------------------------------------------------------------------------


def _rss(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            main = psutil.Process(pid)
            for proc in [main, *main.children(recursive=True)]:
                total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total / MIB


def _service_log(service: LoopbackHandle) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    while True:
        page = service.log(since=len(rows))
        if not page:
            return rows
        rows.extend(page)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _save_log(path: Path, log: list[dict[str, Any]]) -> None:
    """The service's call log of one subject's run, for a reader's own analysis."""
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(LOG_FIELDS))
        writer.writeheader()
        writer.writerows(log)


def run_subject(ctx: Ctx, case: Case, subject: Subject, run: str = "") -> dict[str, Any]:
    """Start the service and the subject, submit the case's jobs, watch until done or the cap,
    and work out the figures. Everything it started is stopped when it returns. ``run``: what
    tells this run's call log from the others' of the subject (``-2``, ...)."""
    with ctx.scope():
        service = start_loopback(
            case.loop_keys(), latency=case.latency, tokens_range=case.tokens, seed=SEED
        )
        ctx.later(service.stop)
        ctx.step(f"goodput {case.name}: starting {subject.name}")
        subject.start(ctx, case, service)
        service.reset()
        started, peak_rss, drained, zeros = time.monotonic(), 0.0, False, 0
        wall_start = time.time()
        subject.submit(case.jobs)
        while time.monotonic() - started < case.cap:
            time.sleep(POLL)
            ok = sum(k["ok"] for k in service.stats()["keys"].values())
            peak_rss = max(peak_rss, _rss(subject.pids()))
            left = subject.left()
            elapsed = time.monotonic() - started
            ctx.step(f"goodput {case.name}: {subject.name} {ok:,}/{case.jobs:,} calls ok, "
                     f"{elapsed:.0f}/{case.cap:.0f} s")  # fmt: skip
            zeros = zeros + 1 if left == 0 and ok > 0 else 0
            if zeros >= 2:  # twice: a broker message in transit is in no list for a moment
                drained = True
                break
        until = time.time()
        stats = service.stats()
        log = _service_log(service)
        _save_log(ctx.log_dir / f"{case.name}-{_slug(subject.name)}{run}-calls.csv", log)
        failed = subject.failed()
    end = figures_until(log, drained, until)
    figures = analyse(log, case, end)
    keys = stats["keys"].values()
    missing = case.jobs - figures.done - failed
    return {
        "steady": figures.steady,
        "steady_span": figures.steady_span,
        "seconds": round(until - wall_start, 1),
        "drained": drained,
        "done": figures.done,
        "failed": failed,
        "lost": missing if drained else None,
        "unfinished": 0 if drained else missing,
        "duplicated": figures.duplicated,
        "http_429": figures.http_429,
        "errors": figures.errors,
        "peak_per_key": max(k["peak_attempted"] for k in keys),
        "peak_admitted_per_key": max(k["peak_in_flight"] for k in keys),
        "concurrency": case.concurrency,
        "rss_mib": round(peak_rss, 1),
        "calls": len(log),
        **_slot_figures(figures.slots),
        **_token_figures(case, log, keys, end),
        **_learned_figures(case, log, end),
    }


def _slot_figures(slots: Slots | None) -> dict[str, Any]:
    if slots is None:
        return {}
    return {
        "keys_busy": slots.busy,
        "slot_idle_p50_ms": slots.idle_p50 * 1000,
        "slot_idle_p90_ms": slots.idle_p90 * 1000,
        "slot_refills": slots.refills,
    }


def _learned_figures(case: Case, log: list[dict[str, Any]], until: float) -> dict[str, Any]:
    """Keys whose true limit is below the declared one: after a warm-up of :data:`WARMUP`
    seconds from the first call, the share of calls answered 429 and the jobs/s, against the
    true limit."""
    if case.true_concurrency is None or not log:
        return {}
    start = min(e["start"] for e in log) + WARMUP
    after = [e for e in log if e["start"] >= start]
    done = sum(1 for e in log if e["status"] == 200 and start <= e["end"] <= until)
    rate = done / (until - start) if until > start else None
    return {
        "warmup_s": WARMUP,
        "calls_after_warmup": len(after),
        "http_429_after_warmup": sum(1 for e in after if e["status"] == 429),
        "http_429_share_after_warmup": (
            sum(1 for e in after if e["status"] == 429) / len(after) if after else None
        ),
        "jobs_s_after_warmup": rate,
        "of_true_limit_after_warmup": rate / limit(case) if rate is not None else None,
        "true_concurrency": case.true_concurrency,
    }


def _token_figures(
    case: Case, log: list[dict[str, Any]], keys: Any, until: float
) -> dict[str, Any]:
    """With a token budget: the most tokens a key had in any window (the service's log and its
    own peak), against the budget; and the tokens admitted per minute over the steady part
    (whole windows of 60 s after the first, as for jobs/s), against K·T."""
    if case.tpm is None:
        return {}
    peaks = window_peaks(log, 60.0)
    per_min = steady_tokens(log, until)
    return {
        "tpm": case.tpm,
        "peak_window_tokens": max(peaks.values(), default=0),
        "peak_window_tokens_attempted": max(k["peak_window_tokens_attempted"] for k in keys),
        "http_429_tokens": sum(k["http_429_tokens"] for k in keys),
        "tokens_per_min": per_min,
        "of_token_limit": per_min / (case.keys * case.tpm) if per_min is not None else None,
    }


def steady_tokens(log: list[dict[str, Any]], until: float, period: float = 60.0) -> float | None:
    """Tokens of the calls the service admitted (answered 200) in the whole windows of
    ``period`` after the first one, per minute: what a token budget is judged by. Counted at
    admission (a call's start), as the service counts them; None without a whole window."""
    span = steady_windows(min(e["start"] for e in log), until, period) if log else None
    if span is None:
        return None
    lo, hi = span
    tokens = sum(e["tokens"] for e in log if e["status"] == 200 and lo <= e["start"] < hi)
    return tokens * 60.0 / (hi - lo)


def figures_until(log: list[dict[str, Any]], drained: bool, until: float) -> float:
    """The end of the run for the steady part: the last completion when the subject drained,
    else the moment it was stopped."""
    if drained:
        ends = [e["end"] for e in log if e["status"] == 200]
        return max(ends, default=until)
    return until


# --- the scenario -----------------------------------------------------------------------------


def _rows(case: Case, subjects: list[Subject]) -> dict[str, Row]:
    base = f"{case.name}: asyncio script"
    lim = f"{case.name}: physical limit"
    rows = {
        lim: Row("goodput", lim, "jobs/s", [limit(case)], note=_describe(case)),
    }
    for s in subjects:
        comparisons = [Comparison(lim, _limit_target(case, s.name), "of the limit")]
        if s.name != "asyncio script":
            target = (
                Target("ratio_min", 1.0, "≥ 1x") if s.name.startswith("harvest async") else None
            )
            comparisons.append(Comparison(base, target, "vs asyncio script"))
        subject = f"{case.name}: {s.name}"
        rows[subject] = Row("goodput", subject, "jobs/s", comparisons=comparisons)
    if case.tpm is not None:
        rows.update(_token_rows(case, subjects))
    return rows


def _token_rows(case: Case, subjects: list[Subject]) -> dict[str, Row]:
    """With a token budget, the budget itself is the limit a user reads: tokens admitted per
    minute (steady part) against K·T, beside the jobs/s rows (which depend on the tokens the
    calls happened to draw)."""
    assert case.tpm is not None
    lim = f"{case.name}: token limit"
    note = f"{case.keys} keys x {case.tpm:,} tokens/min"
    rows = {lim: Row("goodput", lim, "tokens/min", [float(case.keys * case.tpm)], note=note)}
    for s in subjects:
        target = (
            Target("ratio_min", 0.95, "≥ 0.95 of the token limit")
            if s.name.startswith("harvest async")
            else None
        )
        name = f"{case.name}: {s.name}, tokens"
        comparisons = [Comparison(lim, target, "of the token limit")]
        rows[name] = Row("goodput", name, "tokens/min", comparisons=comparisons)
    return rows


def _limit_target(case: Case, name: str) -> Target | None:
    if case.true_concurrency is not None:  # the mark: after a warm-up of 30 s
        return Target("ratio_min", 0.9, "≥ 0.9 of the true limit") if name != "asyncio script" \
            else None  # fmt: skip
    if name.startswith("harvest async"):
        return Target("ratio_min", 0.95, "≥ 0.95 of the limit")
    if name == "harvest sync threads" and case.name != "huge":
        return Target("ratio_min", 0.9, "≥ 0.9 of the limit")
    return None


def _describe(case: Case) -> str:
    tokens = (f", {case.tpm:,} tokens/min a key, calls of {case.tokens[0]:,}-{case.tokens[1]:,} "
              f"tokens" if case.tpm and case.tokens else "")  # fmt: skip
    true = f" (true C={case.true_concurrency})" if case.true_concurrency else ""
    return (f"{case.keys} keys, C={case.concurrency}{true}, {case.rate_text}{tokens}, "
            f"L={case.latency:g} s "
            f"(mean {mean_latency(case.latency, SIGMA):.3f} s); {case.jobs:,} jobs, "
            f"cap {case.cap:g} s a subject")  # fmt: skip


def run(ctx: Ctx) -> list[Row]:
    cfg = ctx.cfg
    cases = QUICK if cfg.quick else FULL
    chosen = cfg.goodput_cases or tuple(c.name for c in cases)
    names = list(cfg.goodput_subjects or SUBJECTS)
    pool = cfg.goodput_async_pool
    picked = [c for c in cases if c.name in chosen]
    reps = cfg.goodput_reps  # at least 1 (bench.cli)
    ctx.plan(len(picked) * len(names) * reps)
    rows: list[Row] = []
    for case in picked:
        subjects = make_subjects(names, pool, dict(cfg.harvest_knobs))
        by_name = _rows(case, subjects)
        rows.extend(by_name.values())
        ctx.record(*by_name.values())
        runs: dict[str, list[dict[str, Any]]] = {}
        for rep in range(reps):  # the subjects take turns: each rep runs every one once
            for subject in subjects:
                name = f"{case.name}: {subject.name}"
                row = by_name[name]
                try:
                    figures = run_subject(ctx, case, subject, f"-{rep + 1}" if reps > 1 else "")
                except Exception as exc:
                    row.unavailable = f"failed: {type(exc).__name__}: {exc}"[:300]
                    ctx.step(f"goodput {case.name}: {subject.name} failed", 1)
                    continue
                figures["limit"] = limit(case)
                figures["settings"] = getattr(subject, "settings_used", {})
                runs.setdefault(name, []).append(figures)
                row.extra["goodput"] = combined(runs[name])
                if figures["steady"] is None:
                    row.unavailable = f"no steady rate: {figures['steady_span']}"
                else:
                    row.values.append(figures["steady"])
                row.note = figures["steady_span"]
                tokens = by_name.get(f"{name}, tokens")
                if tokens is not None and figures.get("tokens_per_min") is not None:
                    tokens.values.append(figures["tokens_per_min"])
                    tokens.note = "tokens admitted (200) in the steady windows, per minute"
                ctx.step(f"goodput {name} {figures['steady'] or 0:,.1f} jobs/s", 1)
    return rows


# What one subject's runs show together: each count summed (a 429, a lost or a duplicated job in
# any run shows), each peak the highest, jobs/s the median run's.
_SUMMED = ("failed", "unfinished", "duplicated", "http_429", "errors")
_HIGHEST = ("peak_per_key", "peak_admitted_per_key", "rss_mib", "seconds")


def combined(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One subject's figures over its runs (``--goodput-reps``): the median run's (by jobs/s,
    a run without a steady rate the lowest), with the counts of every run summed and the
    peaks the highest of any; ``runs`` keeps each run's jobs/s. One run: its own figures."""
    if len(runs) == 1:
        return runs[0]
    ranked = sorted(runs, key=lambda f: -1.0 if f["steady"] is None else f["steady"])
    out = dict(ranked[(len(ranked) - 1) // 2])  # the lower median: no run that did not happen
    for name in _SUMMED:
        out[name] = sum(f[name] for f in runs)
    for name in _HIGHEST:
        out[name] = max(f[name] for f in runs)
    lost = [f["lost"] for f in runs]
    out["lost"] = None if None in lost else sum(lost)
    out["runs"] = [f["steady"] for f in runs]
    return out
