"""The README's "Running it yourself", followed literally by a new user: a wheel of this tree,
installed in a fresh venv, in a folder outside the repository that holds the README's own
`myjobs.py`; the README's commands (migrate, two workers, beat) run from that folder; jobs
enqueued from Python and with `harvest enqueue` succeed.

The venv's dependencies are cached (keyed by pyproject's dependencies and the Python version,
under ~/.cache/harvest-tests); harvest itself is reinstalled from the fresh wheel every run.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from harvest.procs import ROOT, ProcessGroup
from harvest.settings import Settings
from tests.processes.conftest import wait_until

pytestmark = pytest.mark.slow

README = ROOT / "README.md"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "harvest-tests"


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def readme_myjobs() -> str:
    return next(b for b in code_blocks(section("Defining jobs"), "python") if "# myjobs.py" in b)


def readme_commands() -> tuple[dict[str, str], list[list[str]]]:
    """The variables the first bash block of "Running it yourself" exports, and its commands
    (comments dropped)."""
    block = code_blocks(section("Running it yourself"), "bash")[0]
    exported: dict[str, str] = {}
    commands: list[list[str]] = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            exported |= dict(w.split("=", 1) for w in words[1:])
        elif words:
            commands.append(words)
    return exported, commands


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=300, **kw)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{argv}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done  # type: ignore[no-any-return]


def build_wheel(out: Path) -> Path:
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)])
    [wheel] = out.glob("harvest-*.whl")
    return wheel


def venv_with(wheel: Path) -> Path:
    """A venv with the wheel's dependencies (cached) and harvest from ``wheel`` (always new)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    key = hashlib.sha256(
        json.dumps([pyproject["project"]["dependencies"], sys.version]).encode()
    ).hexdigest()[:16]
    venv = CACHE / f"venv-{key}"
    if not (venv / "bin" / "celery").exists():
        run([sys.executable, "-m", "venv", "--clear", str(venv)])
        run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)])
    run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "--force-reinstall", str(wheel)])
    return venv


@pytest.mark.timeout(600)
def test_the_readme_from_a_wheel_in_a_folder_outside_the_repository(
    migrated: Settings, clean_db: object, redis_client: object, tmp_path: Path
) -> None:
    project = tmp_path / "myproject"  # pytest's tmp folder: not under the repository
    project.mkdir()
    assert ROOT not in project.parents
    (project / "myjobs.py").write_text(readme_myjobs())
    exported, commands = readme_commands()
    assert exported["HARVEST_IMPORTS"] == "myjobs"
    assert [c[:3] for c in commands] == [
        ["harvest", "db", "upgrade"],
        ["celery", "-A", "harvest.worker"],
        ["celery", "-A", "harvest.worker"],
        ["celery", "-A", "harvest.worker"],
    ]

    with locked(CACHE / "venv.lock"):
        venv = venv_with(build_wheel(tmp_path / "wheel"))
        bin_dir = venv / "bin"
        env = {
            "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin",
            "HOME": str(tmp_path),
            "HARVEST_DEV_DIR": str(project / ".harvest"),
            **exported,
            # The README's URLs name the user's servers; the test's own stand in for them.
            "HARVEST_DATABASE_URL": migrated.database_url,
            "HARVEST_REDIS_URL": migrated.redis_url,
        }
        where = run([str(bin_dir / "python"), "-c", "import harvest; print(harvest.__file__)"],
                    cwd=project, env=env).stdout  # fmt: skip
        assert str(venv) in where and str(ROOT) not in where  # the wheel, not this tree

        group = ProcessGroup(env, tmp_path / "logs", cwd=project, repo_on_path=False)
        try:
            for argv in commands:
                exe = [str(bin_dir / argv[0]), *argv[1:]]
                if argv[0] == "harvest":
                    run(exe, cwd=project, env=env)
                else:
                    group.command(f"{argv[3]}-{len(group.procs)}", exe)
            enqueue_and_check(bin_dir, project, env, group)
        finally:
            group.stop()


ENQUEUE = """
from myjobs import app, fetch_page

typed = fetch_page.enqueue(url="https://example.org/typed")
named = app.enqueue("fetch_page", {"url": "https://example.org/named"}, priority=5)
for ref in (typed, named):
    job = app.wait(ref.id, timeout=90)
    print(job.id, job.status, job.result["url"])
"""


def enqueue_and_check(
    bin_dir: Path, project: Path, env: dict[str, str], group: ProcessGroup
) -> None:
    try:
        done = run([str(bin_dir / "python"), "-c", ENQUEUE], cwd=project, env=env)
        assert [line.split()[1:] for line in done.stdout.splitlines()] == [
            ["succeeded", "https://example.org/typed"],
            ["succeeded", "https://example.org/named"],
        ]
        cli_id = run(
            [str(bin_dir / "harvest"), "enqueue", "fetch_page", "--payload",
             '{"url": "https://example.org/cli"}'],
            cwd=project, env=env,
        ).stdout.strip()  # fmt: skip
        assert cli_id.isdigit(), cli_id

        def shown() -> str | None:
            out = run([str(bin_dir / "harvest"), "jobs", "show", cli_id], cwd=project, env=env)
            return out.stdout if re.search(r"status\s+│ succeeded", out.stdout) else None

        assert "https://example.org/cli" in wait_until(shown, 90, 0.5, "the CLI's job")
        logs = group.logs(tail=10**6)
        assert "Traceback" not in logs
        # Celery's default level (WARNING), as these commands run: no line for a job that
        # started or succeeded (`-l INFO` shows them).
        assert "event=job." not in logs
    except AssertionError:
        print(group.logs())
        raise
