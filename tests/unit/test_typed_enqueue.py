"""Typed enqueue: what ``@app.job`` returns calls the handler as before, and enqueues itself
with the handler's own parameters, checked by ``mypy --strict``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harvest import Harvest, JobContext, JobFunction
from harvest.errors import InvalidPayload
from harvest.settings import Settings

ROOT = Path(__file__).resolve().parents[2]

SNIPPET = """
from harvest import Harvest, JobContext

app = Harvest()


@app.job("fetch_page")
def fetch_page(ctx: JobContext, url: str, depth: int = 0) -> dict[str, object]:
    return {"url": url, "depth": depth}


fetch_page.enqueue(url="https://example.org")
fetch_page.enqueue("https://example.org", depth=2)
fetch_page.options(priority=5, delay=10).enqueue(url="https://example.org")
result: dict[str, object] = fetch_page(JobContext(1, 1, 1, "fetch_page"), "https://e.org")
app.enqueue("fetch_page", {"url": "https://example.org"})
fetch_page.enqueue(url=42)  # E: arg-type
fetch_page.enqueue(uri="https://example.org")  # E: call-arg
fetch_page.enqueue()  # E: call-arg
fetch_page.enqueue("https://example.org", depth="2")  # E: arg-type
fetch_page.options(priorty=5).enqueue(url="https://example.org")  # E: call-arg
"""


def test_mypy_rejects_a_wrong_argument_and_accepts_the_right_ones(tmp_path: Path) -> None:
    path = tmp_path / "snippet.py"
    path.write_text(textwrap.dedent(SNIPPET))
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    expected = {
        (n, line.split("# E: ")[1])
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "# E: " in line
    }
    found = {
        (int(line.split(":")[1]), line.rsplit("[", 1)[1].rstrip("]"))
        for line in done.stdout.splitlines()
        if ": error: " in line
    }
    assert found == expected, done.stdout + done.stderr


@pytest.fixture
def app() -> Harvest:
    return Harvest(Settings(database_url="postgresql+psycopg://nobody@127.0.0.1:1/none"))


def test_the_job_object_calls_the_handler_and_keeps_its_name(app: Harvest) -> None:
    @app.job("fetch_page")
    def fetch_page(ctx: JobContext, url: str, depth: int = 0) -> dict[str, object]:
        """Fetch one page."""
        return {"url": url, "depth": depth, "job": ctx.job_id}

    assert isinstance(fetch_page, JobFunction)
    assert fetch_page(JobContext(7, 1, 1, "fetch_page"), "u", depth=1) == {
        "url": "u",
        "depth": 1,
        "job": 7,
    }
    assert (fetch_page.__name__, fetch_page.__doc__) == ("fetch_page", "Fetch one page.")
    assert app.jobs["fetch_page"].func is fetch_page.func  # the worker calls the handler itself
    assert fetch_page.payload(("u",), {"depth": 3}) == {"url": "u", "depth": 3}


def test_positional_arguments_are_named_and_checked(app: Harvest) -> None:
    @app.job("two")
    def two(ctx: JobContext, a: int, b: int = 0) -> None:
        pass

    assert two.payload((1, 2), {}) == {"a": 1, "b": 2}
    with pytest.raises(InvalidPayload, match="both by position and by keyword"):
        two.payload((1,), {"a": 1})
    with pytest.raises(InvalidPayload, match="3 positional arguments"):
        two.payload((1, 2, 3), {})


def test_a_job_object_registered_on_a_second_app_registers_its_handler(app: Harvest) -> None:
    @app.job("shared")
    def shared(ctx: JobContext) -> None:
        pass

    other = Harvest(app.settings)
    again = other.job("shared")(shared)
    assert other.jobs["shared"].func is shared.func
    assert again.app is other
