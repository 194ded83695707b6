"""The README's "Testing your jobs" example, run as written: its conftest.py, its test file and
the README's own myjobs.py in a fresh folder, under pytest, against the test server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg

from harvest.settings import Settings
from tests.conftest import ADMIN_URL
from tests.processes.test_readme_install import code_blocks, readme_myjobs, section


def test_the_readme_testing_example_passes(migrated: Settings, tmp_path: Path) -> None:
    blocks = code_blocks(section("Defining jobs"), "python")
    files = {
        "myjobs.py": readme_myjobs(),
        "conftest.py": next(b for b in blocks if b.startswith("# conftest.py")),
        "test_myjobs.py": next(b for b in blocks if b.startswith("# test_myjobs.py")),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HARVEST_", "PYTEST_"))}
    env |= {"HARVEST_DATABASE_URL": migrated.database_url, "HARVEST_REDIS_URL": migrated.redis_url}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_myjobs.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "1 passed" in done.stdout
    # Its test database (named after ours) was dropped at the end.
    ours = migrated.database_url.rsplit("/", 1)[1]
    with psycopg.connect(ADMIN_URL) as conn:
        left = conn.execute(
            "SELECT datname FROM pg_database WHERE starts_with(datname, %s)", (f"{ours}_test_",)
        ).fetchall()
    assert left == []
