"""``python -m bench``: run the scenarios, show progress, print and write the results.

python -m bench                    # everything (~50 minutes on 2 cores, goodput ~30 of them)
python -m bench --quick            # small sizes, 1 repetition (~8 minutes)
python -m bench --only e2e,claim   # some scenarios
python -m bench --knob HARVEST_INFLIGHT_WINDOW=2000   # tune harvest as a user would
python -m bench --only goodput --goodput-cases huge --goodput-subjects async,asyncio
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from bench import claim, e2e, enqueue, goodput, growth, keypool, latency, memory, report, scale
from bench.core import Row
from bench.env import (
    DEFAULT_ADMIN_URL,
    DEFAULT_REDIS_BASE,
    RESULTS,
    Ctx,
    Reaper,
    services,
)
from bench.goodput_subjects import SUBJECTS as GOODPUT_SUBJECTS


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    run: Callable[[Ctx], list[Row]]


SCENARIOS = (
    Scenario("e2e", "end to end: N no-op jobs, 2 processes", e2e.run),
    Scenario("gate", "end to end with the key pool gate", e2e.run_gate),
    Scenario("enqueue", "enqueue: single and bulk", enqueue.run),
    Scenario("claim", "dispatch claim from 2 processes", claim.run),
    Scenario("latency", "enqueue-to-start", latency.run),
    Scenario("growth", "claim latency as the table grows", growth.run),
    Scenario("scale", "per-job costs; claim and retention on a big history", scale.run),
    Scenario("memory", "execution worker RSS", memory.run),
    Scenario("keypool", "key pool lease+release", keypool.run),
    Scenario("goodput", "jobs/s through rate-limited keys", goodput.run),
)


# Every scenario runs harvest's workers as the README runs them, at Celery's default log level
# (WARNING), where a job that starts or succeeds writes no line. The bench starts them at
# -l INFO (it waits for Celery's "ready." line), so it turns the job lines off; the plain Celery
# baselines run at WARNING (bench.baselines.plain says when they are ready). --knob
# HARVEST_JOB_LOG=all measures harvest with the lines.
AS_THE_README = {"HARVEST_JOB_LOG": "off"}


@dataclass(frozen=True)
class Config:
    quick: bool
    reps: int
    jobs: int
    harvest_knobs: dict[str, str] = field(default_factory=dict)
    goodput_cases: tuple[str, ...] = ()  # () = every case
    goodput_subjects: tuple[str, ...] = ()  # () = every subject
    goodput_async_pool: str = "prefork"
    goodput_reps: int = 1  # runs of each goodput subject (a full run of every case: 30 min)
    scale_history: int = 0  # 0: 10,000,000 (200,000 with --quick)


def parse(argv: list[str] | None) -> argparse.Namespace:
    names = ", ".join(s.name for s in SCENARIOS)
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="harvest's benchmarks, side by side with baselines."
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 repetition")
    parser.add_argument("--only", default="", help=f"comma-separated scenarios of: {names}")
    parser.add_argument("--reps", type=int, help="measured repetitions (default 3; 1 quick)")
    parser.add_argument("--jobs", type=int, help="jobs per end-to-end run (default 20,000)")
    parser.add_argument(
        "--knob",
        action="append",
        default=[],
        metavar="HARVEST_X=VALUE",
        help="a setting for harvest's workers (repeatable)",
    )
    cases = ", ".join(c.name for c in goodput.FULL)
    parser.add_argument("--goodput-cases", default="", help=f"goodput cases of: {cases}")
    parser.add_argument(
        "--goodput-subjects", default="", help=f"goodput subjects of: {', '.join(GOODPUT_SUBJECTS)}"
    )
    parser.add_argument(
        "--goodput-async",
        choices=("prefork", "solo"),
        default="prefork",
        help="pool of harvest's async subject: prefork -c 2 (default) or solo",
    )
    parser.add_argument(
        "--goodput-reps",
        type=int,
        default=1,
        help="runs of each goodput subject, the subjects taking turns; jobs/s is the median "
        "run's, the counts summed over the runs (default 1: every case once is 30 minutes)",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=0,
        help="finished jobs in the scale scenario's history (default 10,000,000; 200,000 quick)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    parser.add_argument("--admin-url", default=DEFAULT_ADMIN_URL, help="Postgres admin database")
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_BASE, help="Redis, no db number")
    args = parser.parse_args(argv)
    known = {s.name for s in SCENARIOS}
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in known]
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}: choose from {names}")
    for knob in args.knob:
        if "=" not in knob or not knob.startswith("HARVEST_"):
            parser.error(f"--knob takes HARVEST_NAME=VALUE, got {knob!r}")
    args.chosen = chosen
    args.goodput_cases = _pick(parser, args.goodput_cases, [c.name for c in goodput.FULL])
    args.goodput_subjects = _pick(parser, args.goodput_subjects, list(GOODPUT_SUBJECTS))
    return args


def _pick(parser: argparse.ArgumentParser, text: str, known: list[str]) -> tuple[str, ...]:
    picked = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in picked if s not in known]
    if unknown:
        parser.error(f"unknown {', '.join(unknown)}: choose from {', '.join(known)}")
    return picked


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cfg = Config(
        quick=args.quick,
        reps=max(1, args.reps or (1 if args.quick else 3)),
        jobs=max(100, args.jobs or (1_000 if args.quick else 20_000)),
        harvest_knobs={**AS_THE_README, **dict(k.split("=", 1) for k in args.knob)},
        goodput_cases=args.goodput_cases,
        goodput_subjects=args.goodput_subjects,
        goodput_async_pool=args.goodput_async,
        goodput_reps=max(1, args.goodput_reps),
        scale_history=max(0, args.history),
    )
    chosen = [s for s in SCENARIOS if not args.chosen or s.name in args.chosen]
    console = Console()
    if not console.is_terminal:  # a log file or a pipe: do not squeeze the table into 80
        console = Console(width=160)
    reaper = Reaper()
    rows: list[Row] = []
    errors: dict[str, str] = {}
    done: list[dict[str, Any]] = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_root = RESULTS / "logs" / stamp
    info: dict[str, Any] = {}
    interrupted = False
    with _sigterm_as_interrupt():
        try:
            with services(args.admin_url, args.redis_url) as svc:
                info = {
                    "started_at": report.now_iso(),
                    "machine": report.machine(),
                    "versions": report.versions(svc),
                    "config": asdict(cfg),
                    "logs": str(log_root),
                }
                report.print_header(console, info)
                interrupted = _run_all(
                    console, cfg, svc, reaper, chosen, log_root, rows, errors, done
                )
        except KeyboardInterrupt:
            interrupted = True
        finally:
            reaper.stop_all()
    if not info:
        console.print("[red]no services: nothing was run[/]")
        return 1
    info["finished_at"] = report.now_iso()
    info["load_average_at_end"] = report.machine()["load_average"]
    info["interrupted"] = interrupted
    report.write_json(args.out, info, rows, done)
    title = f"harvest benchmarks ({'quick' if cfg.quick else 'full'}, {cfg.reps} rep(s))"
    console.print(report.table(rows, errors, title))
    if any("goodput" in r.extra for r in rows):
        console.print(report.goodput_table(rows))
    if any("scale_cost" in r.extra for r in rows):
        console.print(report.scale_table(rows))
    console.print(f"results: {args.out}   logs: {log_root}", highlight=False)
    if interrupted:
        console.print("[yellow]interrupted: partial results[/]")
        return 130
    return 1 if errors else 0


def _run_all(
    console: Console,
    cfg: Config,
    svc: Any,
    reaper: Reaper,
    chosen: list[Scenario],
    log_root: Path,
    rows: list[Row],
    errors: dict[str, str],
    done: list[dict[str, Any]],
) -> bool:
    columns = (
        TextColumn("{task.fields[name]:<8}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        overall = progress.add_task("", total=len(chosen), name="all")
        for scenario in chosen:
            task = progress.add_task(scenario.title, total=None, name=scenario.name)
            started = time.monotonic()
            entry: dict[str, Any] = {"name": scenario.name, "title": scenario.title}
            ctx = Ctx(scenario.name, cfg, svc, reaper, log_root / scenario.name,
                      progress=_reporter(progress, task))  # fmt: skip
            try:
                ctx.open()
                ctx.record(*scenario.run(ctx))
            except KeyboardInterrupt:
                entry["error"] = "interrupted"
                return True
            except Exception as exc:
                errors[scenario.name] = f"{type(exc).__name__}: {exc}"
                entry["error"] = errors[scenario.name]
                entry["traceback"] = traceback.format_exc()
                progress.console.print(f"[red]{scenario.name} failed:[/] {errors[scenario.name]}")
            finally:
                rows.extend(ctx.rows)
                ctx.close()
                entry["seconds"] = round(time.monotonic() - started, 1)
                done.append(entry)
                progress.update(task, description=f"done in {entry['seconds']:.0f}s")
                if progress.tasks[task].total is not None:
                    progress.update(task, completed=progress.tasks[task].total)
                progress.advance(overall)
    return False


def _reporter(progress: Progress, task: TaskID) -> Callable[[str, float, float | None], None]:
    def report_step(desc: str, advance: float, total: float | None) -> None:
        if total is not None:
            progress.update(task, total=total)
        if desc:
            progress.update(task, description=desc)
        if advance:
            progress.advance(task, advance)

    return report_step
