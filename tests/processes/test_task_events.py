"""Job events follow the worker's task events as Celery has them: a worker started without
``-E`` sends none, ``celery control enable_events`` (what Flower sends) turns them on in its
execution children, ``disable_events`` off again. Read with Celery's own event receiver, as
Flower and ``celery events`` read them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from harvest.app import Harvest
from harvest.worker.events import attempt_task_id
from tests.processes.conftest import Cluster, wait_until

pytestmark = pytest.mark.slow


class Events:
    """Every event on the broker, as Celery's receiver gets them, in a thread."""

    def __init__(self, broker_url: str) -> None:
        self.app = Celery(broker=broker_url, set_as_current=False)
        self.seen: list[dict[str, Any]] = []
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        wait_until(lambda: self._receiver is not None, 10, what="the event receiver")
        time.sleep(0.5)  # its queue is bound

    def _run(self) -> None:
        with self.app.connection_for_read() as conn:
            self._receiver = self.app.events.Receiver(conn, handlers={"*": self.seen.append})
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def of(self, job_id: int) -> list[str]:
        task_id = attempt_task_id(job_id, 1)
        return [e["type"] for e in list(self.seen) if e.get("uuid") == task_id]

    def stop(self) -> None:
        self._receiver.should_stop = True
        self._thread.join(10)
        self.app.close()


@pytest.fixture
def events(cluster: Cluster) -> Iterator[Events]:
    watcher = Events(cluster.settings.effective_broker_url)
    yield watcher
    watcher.stop()


def test_job_events_are_sent_while_the_workers_task_events_are_on(
    cluster: Cluster, client_app: Harvest, events: Events
) -> None:
    cluster.up()  # a schedule worker, an execution worker of 2 processes, beat
    cluster.wait_ready()

    def done(job_id: int) -> bool:
        return client_app.get(job_id).status.value == "succeeded"

    def execution_says(line: str) -> bool:
        return line in cluster.worker_logs("execution")

    quiet = client_app.enqueue("echo", {"value": "before"}).id
    wait_until(lambda: done(quiet), 30, what="the first job")
    time.sleep(1.5)  # events would have arrived by now (sent every 0.25 s)
    assert events.of(quiet) == []

    events.app.control.enable_events()
    wait_until(lambda: execution_says("job events on"), 10, what="job events on")
    loud = client_app.enqueue("echo", {"value": "watched"}).id
    wait_until(lambda: "task-succeeded" in events.of(loud), 30, what="the job's events")
    assert events.of(loud) == ["task-received", "task-started", "task-succeeded"]

    events.app.control.disable_events()
    wait_until(lambda: execution_says("job events off"), 10, what="job events off")
    after = client_app.enqueue("echo", {"value": "after"}).id
    wait_until(lambda: done(after), 30, what="the last job")
    time.sleep(1.5)
    assert events.of(after) == []
