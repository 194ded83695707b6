"""The Celery settings harvest's guarantees rest on (README, "Guarantees")."""

from __future__ import annotations

from harvest.broker import celery_config, sized_for_pool
from harvest.settings import Settings


def test_redis_broker_connections_fail_fast_when_cut_off() -> None:
    options = celery_config(Settings(broker_url="redis://127.0.0.1:6379/3"))[
        "broker_transport_options"
    ]
    # A consumer on a half-open connection (a partition) reconnects within ~1 + 2 x 5 s.
    assert options["health_check_interval"] <= 5
    assert options["socket_timeout"] > 1.0  # above kombu's 1 s BRPOP
    assert options["socket_keepalive"] is True
    assert options["visibility_timeout"] > Settings().max_timeout


def test_rabbitmq_gets_no_redis_socket_options() -> None:
    config = celery_config(Settings(broker_url="amqp://guest:guest@127.0.0.1:5672//"))
    assert set(config["broker_transport_options"]) == {"visibility_timeout"}


def test_json_only_and_acks_late() -> None:
    config = celery_config(Settings())
    assert config["accept_content"] == ["json"]
    assert config["task_acks_late"] and config["task_reject_on_worker_lost"]
    assert config["worker_prefetch_multiplier"] == 1


def test_task_events_follow_the_setting() -> None:
    assert celery_config(Settings())["worker_send_task_events"] is False  # as Celery: -E
    assert celery_config(Settings(task_events=True))["worker_send_task_events"] is True
    assert celery_config(Settings(task_events=False))["worker_send_task_events"] is False


def test_short_jobs_share_messages_spread_over_the_consumers() -> None:
    from harvest.broker import jobs_per_message

    fast = 0.001  # a 1 ms job: up to 50 fit in a message's 50 ms
    assert jobs_per_message(1, 16, 2, fast) == 1
    assert jobs_per_message(2, 16, 2, fast) == 1  # one each
    assert jobs_per_message(4, 16, 2, fast) == 2
    assert jobs_per_message(5, 16, 2, fast) == 3  # messages of 3 and 2
    assert jobs_per_message(100, 16, 2, fast) == 16
    assert jobs_per_message(100, 16, 50, fast) == 2
    assert jobs_per_message(100, 16, 2, 0.01) == 5  # 10 ms jobs: 5 make 50 ms


def test_long_or_unknown_jobs_travel_one_a_message() -> None:
    """A message's jobs run one after another in one process: long jobs must not queue
    behind each other while another process idles (chaos F3: 8 s jobs, 4 processes)."""
    from harvest.broker import jobs_per_message

    assert jobs_per_message(3, 16, 2, 8.0) == 1
    assert jobs_per_message(1000, 16, 2, 0.2) == 1
    assert jobs_per_message(1000, 16, 2, None) == 1  # nothing finished yet: no run time


def test_async_jobs_are_spread_over_the_consumers_in_larger_messages_whatever_their_time() -> None:
    """An async job's message runs its jobs at once: neither its run time nor the sync bound
    holds it to small messages, only the spread over the consumers and 8 x the bound."""
    from harvest.broker import jobs_per_message

    assert jobs_per_message(200, 16, 2, None, concurrent=True) == 100
    assert jobs_per_message(200, 16, 2, 30.0, concurrent=True) == 100  # long: still together
    assert jobs_per_message(1000, 16, 2, None, concurrent=True) == 128
    assert jobs_per_message(1000, 4, 2, None, concurrent=True) == 32
    assert jobs_per_message(3, 16, 2, None, concurrent=True) == 2  # one consumer each, or so


def test_chunk_groups_by_queue_and_name() -> None:
    import uuid

    from harvest.broker import chunk
    from harvest.jobs import Claimed

    jobs = [Claimed(i, uuid.uuid4(), "execution", "a" if i % 2 else "b") for i in range(10)]
    messages = chunk(jobs, {"a": 5})
    assert sorted(len(m) for m in messages) == [1, 1, 1, 1, 1, 5]
    assert all(len({j.name for j in m}) == 1 for m in messages)
    assert sorted(j.id for m in messages for j in m) == list(range(10))


def test_workers_use_harvests_consumer() -> None:
    from celery.utils.imports import symbol_by_name
    from celery.worker.consumer import Consumer as CeleryConsumer

    from harvest.worker import app

    # What a worker started with `celery -A harvest.worker` builds its consumer from.
    consumer = symbol_by_name(app.conf.worker_consumer)
    assert consumer.__module__ == "harvest.worker.consumer"
    assert issubclass(consumer, CeleryConsumer)


def test_celerys_warning_about_cancelling_on_connection_loss_is_not_repeated() -> None:
    """Celery warns at every lost broker connection that Celery 6 will cancel running tasks
    unless worker_cancel_long_running_tasks_on_connection_loss says otherwise; harvest sets it
    to False on purpose, and its consumer keeps the warning out of the log, installed after the
    worker's own filter (``always``, put in front by Celery's log setup). The same warning,
    Celery's own text, printed in a process without harvest's filter (the canary)."""
    import subprocess
    import sys

    warn = (
        "import warnings\n"
        "from celery.exceptions import CPendingDeprecationWarning\n"
        "from celery.worker.consumer.consumer import CANCEL_TASKS_BY_DEFAULT\n"
        "warnings.filterwarnings('always', category=CPendingDeprecationWarning)  # the worker's\n"
        "{before}\n"
        "warnings.warn(CANCEL_TASKS_BY_DEFAULT, CPendingDeprecationWarning, stacklevel=2)\n"
    )
    assert celery_config(Settings())["worker_cancel_long_running_tasks_on_connection_loss"] is False

    def stderr(before: str) -> str:
        code = warn.format(before=before)
        argv = [sys.executable, "-c", code]
        run = subprocess.run(argv, check=False, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stderr

    assert "In Celery 5.1 we introduced" in stderr("")
    assert stderr("import harvest.worker.consumer as c; c.quiet_cancel_warning()") == ""


def test_a_threads_or_gevent_worker_gets_a_redis_connection_for_each_ack_at_once() -> None:
    redis_url, amqp_url = "redis://127.0.0.1:6379/3", "amqp://guest:guest@127.0.0.1:5672//"
    options = celery_config(Settings(broker_url=redis_url))["broker_transport_options"]
    assert sized_for_pool(options, redis_url, "gevent", 100)["max_connections"] == 110
    assert sized_for_pool(options, redis_url, "threads", 64)["max_connections"] == 74
    assert sized_for_pool({"max_connections": 500}, redis_url, "threads", 64) == {
        "max_connections": 500  # a user's larger figure stands
    }
    assert sized_for_pool(options, redis_url, "prefork", 100) == options
    assert sized_for_pool({}, amqp_url, "gevent", 100) == {}
