"""The dashboard in a real browser (headless Chromium) against a running harvest: real
Postgres, Redis and Celery workers. Screenshots of every page go to tests/artifacts/web/."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from playwright.sync_api import expect
from sqlalchemy import Engine

from harvest.app import Harvest
from harvest.coordination.key_pool import Busy, KeyPool
from harvest.keystore import Cipher
from harvest.models import JobStatus
from harvest.procs import ProcessGroup
from tests.web.conftest import add_keys, screenshot
from tests.web.helpers import db_depth, end_as
from tests.web.jobs import FLAG

pytestmark = pytest.mark.slow


def _eventually(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.3)


def test_the_overview_shows_the_counts_the_database_holds(
    page: Any, harvest: Harvest, clean_db: Engine
) -> None:
    noop = harvest.enqueue_many("web_noop", [{"n": i} for i in range(9)])
    bulk = harvest.enqueue_many("web_bulk", [{"n": i} for i in range(5)])
    end_as(clean_db, noop[:4], "succeeded")
    end_as(clean_db, noop[4:6], "failed", "RuntimeError: down")
    end_as(clean_db, bulk[:1], "succeeded")
    harvest.cancel(bulk[1])
    expected = db_depth(clean_db)
    assert len(expected) == 6

    page.goto("/")
    expect(page.locator("h1")).to_have_text("Overview")
    for (queue, status), n in expected.items():
        cell = page.locator(f'td[data-queue="{queue}"][data-status="{status}"]')
        expect(cell).to_have_text(str(n))
    for status in JobStatus:
        total = sum(n for (_, s), n in expected.items() if s == status.value)
        expect(page.locator(f'[data-total="{status.value}"]')).to_have_text(str(total))
    expect(page.locator('[data-figure="outcomes"]')).to_have_text("5 / 2 / 1")
    expect(page.locator('[data-figure="failed"]')).to_have_text("2")
    assert page.locator("svg.chart").count() == 3

    # It refreshes by itself: a job enqueued now shows up without a reload.
    harvest.enqueue("web_bulk", {"n": 99})
    cell = page.locator('td[data-queue="bulk"][data-status="pending"]')
    expect(cell).to_have_text(str(expected[("bulk", "pending")] + 1), timeout=12_000)


def test_a_failed_job_is_found_opened_retried_from_the_page_and_succeeds(
    page: Any, harvest: Harvest, workers: ProcessGroup, clean_db: Engine, cipher: Cipher
) -> None:
    workers.up(execution=1, concurrency=2)
    workers.wait_ready()
    ref = harvest.enqueue("web_flaky", {"note": "page-42"})
    harvest.enqueue_many("web_noop", [{"n": i} for i in range(40)])
    batch = harvest.enqueue_batch(
        [("web_noop", {"n": i}) for i in range(6)], on_complete="web_batch_done"
    )
    harvest.schedule("web-every-hour", "web_noop", cron="0 * * * *", payload={"n": 7})
    harvest.schedule("web-every-2s", "web_noop", every=2, payload={"n": 2})
    add_keys(harvest, cipher, "web-pool", {"alpha": "sk-" + "x" * 40, "beta": "sk-" + "y" * 40})
    dead = harvest.wait(ref.id, timeout=60)
    assert dead.status is JobStatus.FAILED
    _eventually(lambda: harvest.batch(batch.id).complete, 60, "the batch to complete")
    _eventually(
        lambda: harvest.get_schedule("web-every-2s").last_fired_at, 30, "the schedule to fire"
    )

    # Found: on the dead jobs page, by name; opened; its traceback shown.
    page.goto("/dead")
    expect(page.locator('tr[data-name="web_flaky"]')).to_contain_text("1")
    screenshot(page, "dead")
    page.locator(f'tr[data-job-id="{ref.id}"] a').first.click()
    expect(page).to_have_url(f"/jobs/{ref.id}")
    expect(page.locator('[data-field="status"]')).to_have_text("failed")
    traceback = page.locator('[data-field="traceback"]')
    expect(traceback).to_contain_text("Traceback (most recent call last)")
    expect(traceback).to_contain_text("RuntimeError: upstream refused 'page-42'")
    expect(traceback).to_contain_text("tests/web/jobs.py")
    screenshot(page, "job-failed")

    # Retried from the page, and seen to succeed.
    harvest.redis.set(FLAG, "1")
    page.get_by_role("button", name="Retry").click()
    expect(page.locator(".message")).to_contain_text("Sent back to pending")

    def succeeded() -> bool:
        page.reload()
        return page.locator('[data-field="status"]').inner_text() == "succeeded"

    _eventually(succeeded, 60, "the retried job to succeed on its page")
    expect(page.locator('[data-field="attempts"]')).to_have_text("2 / 2")
    assert harvest.get(ref.id).result == {"note": "page-42", "attempt": 2}
    screenshot(page, "job-succeeded")

    for path, name in [("/", "overview"), ("/jobs", "jobs"), ("/keys", "keys"),
                       ("/schedules", "schedules"), ("/batches", "batches"),
                       (f"/batches/{batch.id}", "batch")]:  # fmt: skip
        page.goto(path)
        expect(page.locator("h1")).to_be_visible()
        screenshot(page, name)
    page.goto("/batches")
    expect(page.locator(f'tr[data-batch-id="{batch.id}"]')).to_contain_text("6 / 6")

    # Schedules: pause and resume from the page.
    page.goto("/schedules")
    row = page.locator('tr[data-schedule="web-every-hour"]')
    row.get_by_role("button", name="Pause").click()
    expect(row.locator('[data-field="state"]')).to_have_text("paused")
    assert harvest.get_schedule("web-every-hour").enabled is False
    row.get_by_role("button", name="Resume").click()
    expect(row.locator('[data-field="state"]')).to_have_text("active")
    assert harvest.get_schedule("web-every-hour").enabled is True


def test_a_key_disabled_from_the_page_is_never_leased_again(
    page: Any, harvest: Harvest, cipher: Cipher, redis_client: object
) -> None:
    keys = add_keys(
        harvest, cipher, "web-pool",
        {"alpha": "sk-" + "a" * 40, "beta": "sk-" + "b" * 40, "gamma": "sk-" + "c" * 40},
    )  # fmt: skip
    pool = KeyPool(harvest.redis, "web-pool")
    held = pool.lease_many("page-test", 30.0, 6)  # every key busy: utilisation 100 %
    assert not isinstance(held, Busy) and len(held) == 6
    for lease in held[:3]:
        pool.release(lease)

    page.goto("/keys")
    row = page.locator('tr[data-key="beta"]')
    expect(row.locator('[data-field="status"]')).to_have_text("active")
    expect(page.locator("table.keys")).to_contain_text("sk-…aaaa")
    row.get_by_role("button", name="Disable").click()
    expect(page.locator(".message")).to_contain_text("Key disabled")
    expect(row.locator('[data-field="status"]')).to_have_text("disabled")
    screenshot(page, "keys-disabled")

    for lease in held[3:]:
        pool.release(lease)
    leased: set[int] = set()
    for _ in range(40):
        got = pool.lease_many("after-click", 5.0, 6)
        assert not isinstance(got, Busy)
        leased |= {lease.key_id for lease in got}
        for lease in got:
            pool.release(lease)
    assert keys["beta"].id not in leased
    assert leased == {keys["alpha"].id, keys["gamma"].id}

    row.get_by_role("button", name="Enable").click()
    expect(row.locator('[data-field="status"]')).to_have_text("active")
    got = pool.lease_many("after-enable", 5.0, 6)
    assert not isinstance(got, Busy)
    assert keys["beta"].id in {lease.key_id for lease in got}


def test_a_running_job_appears_in_processes_under_its_worker(
    page: Any, harvest: Harvest, workers: ProcessGroup, clean_db: Engine
) -> None:
    """Processes lists each live execution process and the job it runs now; `harvest
    workers` says the same; when the job ends it leaves the list."""
    workers.up(execution=1, concurrency=1)
    workers.wait_ready()
    ref = harvest.enqueue("web_waits", {"seconds": 30})
    _eventually(lambda: harvest.get(ref.id).status is JobStatus.RUNNING, 60, "the job to run")

    def listed() -> bool:
        page.goto("/processes")
        return page.locator(f'[data-process] tr[data-job-id="{ref.id}"]').count() == 1

    _eventually(listed, 30, "the running job on the Processes page")
    process = page.locator(f'[data-process]:has(tr[data-job-id="{ref.id}"])')
    expect(process.locator(f'tr[data-job-id="{ref.id}"]')).to_contain_text("web_waits")
    expect(process.locator(f'tr[data-job-id="{ref.id}"]')).to_contain_text("running")
    worker = harvest.get(ref.id).worker
    assert worker and process.get_attribute("data-process") == worker
    screenshot(page, "processes")
    harvest.cancel(ref.id)
    _eventually(lambda: harvest.get(ref.id).status is JobStatus.CANCELLED, 30, "the cancel")

    def gone() -> bool:
        page.goto("/processes")
        return page.locator(f'tr[data-job-id="{ref.id}"]').count() == 0

    _eventually(gone, 30, "the ended job to leave the Processes page")


def _when(value: Any) -> str:
    """A time as the pages show it in a title (harvest.web.pages.when)."""
    from harvest.web.pages import when

    return when(value)


def test_a_delayed_job_appears_under_scheduled_with_its_run_at(
    page: Any, harvest: Harvest, clean_db: Engine
) -> None:
    later = harvest.enqueue("web_noop", {"n": 1}, delay=3600)
    due = harvest.enqueue("web_noop", {"n": 2})
    page.goto("/jobs")
    page.locator('nav.tabs a[data-state="scheduled"]').click()
    expect(page.locator("nav.tabs a.current")).to_have_text("scheduled")
    row = page.locator(f'tr[data-job-id="{later.id}"]')
    cell = row.locator('[data-field="run-at"]')
    expect(cell).to_have_text(re.compile(r"^in (59|60)m$"))
    expect(cell).to_have_attribute("title", _when(harvest.get(later.id).run_at))
    expect(page.locator(f'tr[data-job-id="{due.id}"]')).to_have_count(0)
    screenshot(page, "jobs-scheduled")
    page.locator('nav.tabs a[data-state="ready"]').click()
    expect(page.locator(f'tr[data-job-id="{due.id}"]')).to_have_count(1)
    expect(page.locator(f'tr[data-job-id="{later.id}"]')).to_have_count(0)


def test_a_retrying_job_shows_its_next_attempt_and_three_attempts_show_three_rows(
    page: Any, harvest: Harvest, workers: ProcessGroup, clean_db: Engine
) -> None:
    workers.up(execution=1, concurrency=2)
    workers.wait_ready()
    waiting = harvest.enqueue("web_retry_later")
    dead = harvest.enqueue("web_three_tries")

    def retrying() -> bool:
        job = harvest.get(waiting.id)
        return job.status is JobStatus.PENDING and job.attempts == 1

    _eventually(retrying, 60, "the first attempt to fail and wait for its retry")
    job = harvest.get(waiting.id)
    page.goto("/jobs?state=retrying")
    row = page.locator(f'tr[data-job-id="{waiting.id}"]')
    expect(row.locator('[data-field="run-at"]')).to_have_attribute("title", _when(job.run_at))
    expect(row.locator('[data-field="run-at"]')).to_have_text(re.compile(r"^in (9|10)m$"))
    expect(row.locator("td.error")).to_contain_text("upstream answered 503 on attempt 1")
    screenshot(page, "jobs-retrying")

    assert harvest.wait(dead.id, timeout=60).status is JobStatus.FAILED
    page.goto(f"/jobs/{dead.id}")
    history = page.locator('[data-field="attempt-history"] tbody tr')
    expect(history).to_have_count(3)
    for n in (1, 2, 3):
        attempt = page.locator(f'[data-field="attempt-history"] tr[data-attempt="{n}"]')
        expect(attempt).to_contain_text(f"try {n} failed")
        expect(attempt).to_contain_text("failed" if n == 3 else "retry")
    screenshot(page, "job-attempts")


def test_a_paused_queue_dispatches_nothing_until_resumed(
    page: Any, harvest: Harvest, workers: ProcessGroup, clean_db: Engine
) -> None:
    workers.up(execution=1, concurrency=2)
    workers.wait_ready()
    harvest.enqueue("web_noop", {"n": 0}, delay=3600)  # the queue is known: it holds a job
    page.goto("/queues")
    row = page.locator('tr[data-queue="execution"]')
    expect(row.locator('[data-field="state"]')).to_have_text("active")
    row.get_by_role("button", name="Pause").click()
    expect(page.locator(".message")).to_contain_text("Queue paused")
    expect(row.locator('[data-field="state"]')).to_have_text("paused")

    refs = harvest.enqueue_many("web_noop", [{"n": i} for i in range(1, 6)])
    harvest.nudge()
    time.sleep(5)  # beat ticks dispatch every 0.5 s: ten chances to take them
    assert {harvest.get(i).status for i in refs} == {JobStatus.PENDING}
    assert all(harvest.get(i).dispatched_at is None for i in refs)
    page.reload()
    expect(row.locator('[data-field="ready"]')).to_have_text("5")
    screenshot(page, "queues-paused")

    row.get_by_role("button", name="Resume").click()
    expect(page.locator(".message")).to_contain_text("Queue resumed")
    for job_id in refs:
        assert harvest.wait(job_id, timeout=60).status is JobStatus.SUCCEEDED


def test_search_finds_a_job_by_a_payload_path(
    page: Any, harvest: Harvest, clean_db: Engine
) -> None:
    wanted = harvest.enqueue("web_flaky", {"note": "https://example.org/wanted"})
    other = harvest.enqueue("web_flaky", {"note": "https://example.org/other"})
    page.goto("/jobs")
    page.get_by_role("searchbox", name="search jobs").fill(
        "payload.note = https://example.org/wanted"
    )
    page.get_by_role("button", name="Search").click()
    expect(page.locator(f'tr[data-job-id="{wanted.id}"]')).to_have_count(1)
    expect(page.locator(f'tr[data-job-id="{other.id}"]')).to_have_count(0)
    expect(page.get_by_role("searchbox", name="search jobs")).to_have_value(
        "payload.note = https://example.org/wanted"
    )
    screenshot(page, "jobs-search")
    page.get_by_role("searchbox", name="search jobs").fill("colour = red")
    page.get_by_role("button", name="Search").click()
    expect(page.locator("main")).to_contain_text("unknown field 'colour'")
