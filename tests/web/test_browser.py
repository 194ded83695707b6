"""The dashboard in a real browser (headless Chromium) against a running harvest: real
Postgres, Redis and Celery workers. Screenshots of every page go to tests/artifacts/web/."""

from __future__ import annotations

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
