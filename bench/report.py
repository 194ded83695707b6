"""What the run prints and writes: the machine and versions, the results table, the JSON."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg
import redis
from rich.console import Console
from rich.table import Table
from rich.text import Text

from bench.core import Row, judge_row, row_dict
from bench.env import ROOT, Services

VERDICT_STYLE = {"met": "green", "floor": "yellow", "missed": "red", "n/a": "dim"}
VERDICT_TEXT = {"met": "met", "floor": "floor met", "missed": "missed", "n/a": ""}


def machine() -> dict[str, Any]:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) * 1024
    except OSError:
        pass
    load = os.getloadavg()
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model or platform.processor(),
        "memory_gib": round(memory / 2**30, 1),
        "platform": platform.platform(),
        "load_average": [round(x, 2) for x in load],
    }


def versions(services: Services) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for package in ("harvest", "celery", "kombu", "sqlalchemy", "psycopg", "redis",
                    "procrastinate", "pgqueuer"):  # fmt: skip
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = "not installed"
    try:
        with psycopg.connect(services.admin_url, connect_timeout=5) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            out["postgres_server"] = str(row[0]) if row else "?"
    except psycopg.Error as exc:
        out["postgres_server"] = f"unknown ({type(exc).__name__})"
    client = redis.Redis.from_url(f"{services.redis_base}/0", socket_timeout=5)
    try:
        out["redis_server"] = str(client.info("server").get("redis_version", "?"))
    except redis.RedisError as exc:
        out["redis_server"] = f"unknown ({type(exc).__name__})"
    finally:
        client.close()
    out["harvest_commit"] = _git_commit()
    return out


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


def _git_commit() -> str:
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{' (modified)' if dirty else ''}"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _num(value: float | None) -> str:
    if value is None:
        return "—"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:,.1f}"
    return f"{value:,.2f}"


def table(rows: list[Row], errors: dict[str, str], title: str) -> Table:
    out = Table(title=title, show_lines=False, header_style="bold")
    for name, justify in (("scenario", "left"), ("subject", "left"), ("median", "right"),
                          ("min", "right"), ("max", "right"), ("unit", "left"),
                          ("ratio vs baseline", "left"), ("target", "left"),
                          ("met/missed", "left")):  # fmt: skip
        out.add_column(name, justify=justify)  # type: ignore[arg-type]
    last = None
    for row in rows:
        scenario = row.scenario if row.scenario != last else ""
        if last is not None and row.scenario != last:
            out.add_section()
        last = row.scenario
        if row.unavailable:
            out.add_row(scenario, row.subject, Text("not available", "yellow"), "", "", row.unit,
                        Text(row.unavailable, "dim"), "", "")  # fmt: skip
            continue
        judged, own = judge_row(row, rows)
        ratios, targets, verdicts = [], [], []
        for j in judged:
            ratios.append(f"{j.ratio:.2f}x {j.label}" if j.ratio is not None else f"— {j.label}")
            targets.append(j.target or "")
            verdicts.append(Text(VERDICT_TEXT[j.verdict], VERDICT_STYLE[j.verdict]))
        if row.target is not None:
            ratios.append("")
            targets.append(row.target.text)
            verdicts.append(Text(VERDICT_TEXT[own], VERDICT_STYLE[own]))
        out.add_row(
            scenario, row.subject, _num(row.median), _num(row.min), _num(row.max), row.unit,
            "\n".join(ratios), "\n".join(targets), Text("\n").join(verdicts),
        )  # fmt: skip
    for scenario, error in errors.items():
        out.add_section()
        out.add_row(scenario, Text("failed", "red"), "", "", "", "", Text(error[:200], "red"),
                    "", "")  # fmt: skip
    return out


def print_header(console: Console, info: dict[str, Any]) -> None:
    m, v = info["machine"], info["versions"]
    console.print(
        f"[bold]machine[/] {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_gib']} GiB, "
        f"load {m['load_average']} at start\n"
        f"[bold]date[/] {info['started_at']}\n"
        f"[bold]versions[/] Python {v['python']}, Celery {v['celery']}, "
        f"Postgres {v['postgres_server']}, Redis {v['redis_server']}, "
        f"procrastinate {v['procrastinate']}, PgQueuer {v['pgqueuer']}, "
        f"harvest {v['harvest']} @ {v['harvest_commit']}",
        highlight=False,
    )


def write_json(
    path: Path, info: dict[str, Any], rows: list[Row], scenarios: list[dict[str, Any]]
) -> None:
    data = dict(info)
    data["scenarios"] = [
        {**s, "rows": [row_dict(r, rows) for r in rows if r.scenario == s["name"]]}
        for s in scenarios
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


# Below this share of the limit, the 40-line asyncio script (nothing but its calls) shows the
# machine, not the keys, bounding a goodput case: on a slower 2-core machine the huge case
# gave the script 0.53 of the limit where another gave it 0.93-0.99.
MACHINE_BOUND = 0.9


def goodput_table(rows: list[Row]) -> Table:
    """The goodput scenario's figures per subject (from the loopback service's records)."""
    out = Table(title="goodput: per subject (the service's own counts)", header_style="bold")
    heads = ("case: subject", "jobs/s", "x limit", "x asyncio", "429s", "peak/C", "lost", "dup",
             "failed", "unfinished", "keys busy", "idle p50/p90 ms", "RSS MiB", "s")  # fmt: skip
    for name in heads:
        out.add_column(name, justify="left" if name == "case: subject" else "right")
    bound: list[str] = []
    for row in rows:
        g = row.extra.get("goodput")
        if g is None:
            continue
        judged, _ = judge_row(row, rows)
        ratios = {j.label: j.ratio for j in judged}
        of_limit = (g["steady"] or 0) / g["limit"] if g["limit"] else None
        script = row.subject.endswith(": asyncio script") and g["steady"]
        if script and of_limit is not None and of_limit < MACHINE_BOUND:
            case = row.subject.removesuffix(": asyncio script")
            bound.append(f"{case}: the asyncio script reached {of_limit:.2f} of the limit")
        vs_script = ratios.get("vs asyncio script")
        over = g["peak_per_key"] > g["concurrency"]
        out.add_row(
            row.subject, _num(g["steady"]), _num(of_limit), _num(vs_script),
            f"{g['http_429']:,}", Text(f"{g['peak_per_key']}/{g['concurrency']}",
                                       "red" if over else ""),
            "—" if g["lost"] is None else f"{g['lost']:,}", f"{g['duplicated']:,}",
            f"{g['failed']:,}", f"{g['unfinished']:,}", _busy(g), _idle(g), _num(g["rss_mib"]),
            _num(g["seconds"]),
        )  # fmt: skip
    if bound:
        out.caption = (
            "; ".join(bound) + ": the machine (its CPU, shared by the service and the subject), "
            "not the keys, bound this run; read the subjects against the script, not the limit"
        )
        out.caption_style = "yellow"
    return out


def _busy(g: dict[str, Any]) -> str:
    """The share of the keys' call slots kept busy (concurrency-bound cases only)."""
    return "—" if g.get("keys_busy") is None else f"{g['keys_busy']:.3f}"


def _idle(g: dict[str, Any]) -> str:
    """How long a freed slot of a key stood idle before the next call (p50/p90, ms)."""
    if g.get("slot_idle_p50_ms") is None:
        return "—"
    return f"{g['slot_idle_p50_ms']:.0f} / {g['slot_idle_p90_ms']:.0f}"


def scale_table(rows: list[Row]) -> Table:
    """The scale scenario's per-job costs of each role (see bench/scale.py)."""
    out = Table(title="scale: cost per job of each role", header_style="bold")
    heads = ("role", "jobs", "xacts", "rows ins/upd/del", "WAL B", "PG CPU µs", "Redis cmds",
             "peak conns", "s")  # fmt: skip
    for name in heads:
        out.add_column(name, justify="left" if name == "role" else "right")
    for row in rows:
        c = row.extra.get("scale_cost")
        if c is None:
            continue
        out.add_row(
            c["role"], f"{c['jobs']:,}", _num(c["xacts"]),
            f"{c['inserted']:.2f} / {c['updated']:.2f} / {c['deleted']:.2f}",
            _num(c["wal_bytes"]), _num(c["postgres_cpu_us"]), _num(c["redis"]),
            f"{c['peak_connections']} ({c['peak_active_connections']} active)", _num(c["seconds"]),
        )  # fmt: skip
    return out
