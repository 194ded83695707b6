"""The same end-to-end path with RabbitMQ as the broker (Redis stays the coordination store)."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from harvest.app import Harvest
from harvest.settings import Settings
from tests.processes.conftest import Cluster, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]


def _rabbit_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture
def vhost() -> Iterator[str]:
    """A private virtual host, so that parallel runs never share queues."""
    if not _rabbit_answers():
        pytest.skip("no RabbitMQ answers on 127.0.0.1:5672")
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        pytest.skip("rabbitmqctl is not installed: cannot make a private vhost")
    name = f"harvest_test_{secrets.token_hex(4)}"
    try:
        subprocess.run([ctl, "add_vhost", name], check=True, capture_output=True, timeout=60)
        subprocess.run(
            [ctl, "set_permissions", "-p", name, "guest", ".*", ".*", ".*"],
            check=True,
            capture_output=True,
            timeout=60,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"rabbitmqctl could not make a vhost: {exc}")
    yield name
    subprocess.run([ctl, "delete_vhost", name], capture_output=True, timeout=60, check=False)


def test_end_to_end_over_rabbitmq(
    migrated: Settings, clean_db: Engine, redis_client: object, tmp_path: Path, vhost: str
) -> None:
    broker = f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
    cluster = Cluster(migrated, tmp_path, broker_url=broker)
    client = Harvest(migrated.model_copy(update={"broker_url": broker}))
    client.load_imports(["tests.jobs"])
    try:
        cluster.up()
        ids = client.enqueue_many("echo", [{"value": i} for i in range(300)])
        failing = client.enqueue("always_fails")

        def done() -> bool:
            with clean_db.connect() as conn:
                n = conn.execute(
                    text("SELECT count(*) FROM harvest_jobs WHERE status = 'succeeded'")
                ).scalar_one()
            return n == 300

        wait_until(done, 120, 0.5, "300 jobs over RabbitMQ")
        assert client.wait(failing.id, timeout=60).status == "failed"
        assert [client.get(i).result["value"] for i in ids[:3]] == [0, 1, 2]
    except AssertionError:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()
        client.close()
    # The broker password never reached a log line.
    assert "guest:guest" not in cluster.logs(tail=10**7)
