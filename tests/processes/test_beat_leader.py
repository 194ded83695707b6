"""Two beats for availability: only the leader sends; a paused leader is replaced, and after
it resumes it does not send again while the other leads."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine

from harvest.settings import Settings
from tests.processes.conftest import Cluster, wait_until

pytestmark = pytest.mark.slow

SENT = re.compile(r"Scheduler: Sending due task")


def _sends(log: Path) -> int:
    return len(SENT.findall(log.read_text(errors="replace")))


def test_only_the_leader_beat_sends(
    migrated: Settings, clean_db: Engine, redis_client: object, tmp_path: Path
) -> None:
    cluster = Cluster(migrated, tmp_path)
    cluster.env["HARVEST_LEADER_TTL"] = "2"
    try:
        first = cluster.beat()
        second = cluster.beat()
        logs = sorted(tmp_path.glob("beat-*.log"))
        assert len(logs) == 2
        wait_until(lambda: sum(_sends(p) for p in logs) >= 6, 30, 0.2, "beat ticks")
        time.sleep(2)
        counts = [_sends(p) for p in logs]
        assert min(counts) == 0 and max(counts) >= 6, counts  # exactly one beat sends
        leader = first if counts[0] else second
        leader_log, standby_log = (logs[0], logs[1]) if counts[0] else (logs[1], logs[0])

        os.killpg(leader.pid, signal.SIGSTOP)  # the leader hangs past its TTL
        wait_until(lambda: _sends(standby_log) >= 3, 30, 0.2, "the standby to take over")
        os.killpg(leader.pid, signal.SIGCONT)
        time.sleep(1.5)  # the old leader resumes, notices, and stands by
        before = _sends(leader_log)
        time.sleep(4)
        assert _sends(leader_log) == before, "a resumed ex-leader kept sending"
        assert _sends(standby_log) > 3
    except AssertionError:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()
