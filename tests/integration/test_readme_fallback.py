"""The README's "Fallback pools" example, as written: its `harvest keys` commands run by the
CLI in their order, its complete.py imported from a fresh folder and run by
``harvest.testing.run_pending`` against the loopback AI service (which says which key called)."""

from __future__ import annotations

import importlib
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.fernet import Fernet
from sqlalchemy import Engine

from harvest.loopback import start_loopback
from harvest.loopback_limits import LoopKey
from harvest.settings import Settings
from harvest.testing import run_pending
from tests.processes.test_readme_install import README, code_blocks

SECRETS = {"AZURE_KEY_1": "sk-azure-east-1-0123456789", "OPENAI_KEY_1": "sk-openai-key-1-0123456"}


def fallback_section() -> str:
    text = README.read_text()
    start = text.index("\n### Fallback pools\n")
    return text[start : text.index("\n## ", start)]


def test_the_readme_fallback_example_runs_as_written(
    migrated: Settings,
    clean_db: Engine,
    redis_client: object,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    [commands] = code_blocks(fallback_section(), "bash")
    [module] = code_blocks(fallback_section(), "python")
    assert module.startswith("# complete.py\n")
    lines = [shlex.split(line, comments=True) for line in commands.splitlines()]
    adds, disable, enable = lines[:2], lines[2], lines[3]
    assert [w[:2] for w in lines] == [["harvest", "keys"]] * 4
    assert disable[2] == "disable" and enable[2] == "enable"

    keys = [
        LoopKey("azure", SECRETS["AZURE_KEY_1"], 4),
        LoopKey("openai", SECRETS["OPENAI_KEY_1"], 2),
    ]
    env = {
        "HARVEST_DATABASE_URL": migrated.database_url,
        "HARVEST_REDIS_URL": migrated.redis_url,
        "HARVEST_SECRET_KEY": Fernet.generate_key().decode(),
    }
    with start_loopback(keys, latency=0.005) as service:
        env |= {"AZURE_GPT4_URL": service.url, "OPENAI_GPT4_URL": service.url}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        harvest_cli = str(Path(sys.executable).parent / "harvest")

        def run(words: list[str]) -> None:
            done = subprocess.run(
                [harvest_cli, *words[1:]], env={**os.environ, **env, **SECRETS},
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr

        for words in adds:
            run(words)
        (tmp_path / "complete.py").write_text(module)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "complete", raising=False)
        complete = importlib.import_module("complete")

        def served(n: int) -> tuple[set[str], set[int]]:
            ids = [complete.app.enqueue("complete", {"prompt": f"p{i}"}).id for i in range(n)]
            run_pending(complete.app)
            jobs = [complete.app.get(i) for i in ids]
            assert {j.status.value for j in jobs} == {"succeeded"}
            return {j.result["pool"] for j in jobs}, {j.attempts for j in jobs}

        assert served(3) == ({"azure-gpt4"}, {1})
        run(disable)
        assert served(3) == ({"openai-gpt4"}, {1})
        run(enable)
        assert served(3) == ({"azure-gpt4"}, {1})
        calls = [(row["key"], row["status"]) for row in service.log()]
        assert calls == [("azure", 200)] * 3 + [("openai", 200)] * 3 + [("azure", 200)] * 3
        complete.app.close()
