"""F13: many hosts through one PgBouncer. Three execution hosts and a fourth that enqueues, each a
network namespace (``tests.chaos.netns``), every harvest process going through one PgBouncer in
transaction mode with fewer server connections than harvest processes. While host D enqueues
at a steady rate, host A dies (SIGKILL of its worker and children: a power cut) and host B is
cut off for 15 s and healed. Nothing may be lost, nothing doubled, no key overlap, and no log
may show what a transaction pooler breaks (prepared statements, advisory locks, startup
parameters)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from harvest.procs import ROOT
from tests.chaos.conftest import World, note_rescues, record, report, victims_of, wait_until
from tests.chaos.netns import cannot_make_namespaces, executions_on, network, relay
from tests.chaos.report import Row
from tests.pgbouncer import POOL_SIZE, PgBouncer, pooler_errors

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

BATCHES, SIZE, EVERY = 80, 5, 0.5  # host D: 400 jobs over 40 s (10 jobs/s)
CUT_SECONDS = 15.0
WORKERS = ("host-a", "host-b", "host-c")
TIMEOUT_ROLE = "5s"  # behind a pooler harvest sends no timeouts: the database sets them


def _running_long_job(world: World, host: str) -> bool:
    return bool(
        world.scalar(
            "SELECT count(*) FROM chaos_executions e JOIN harvest_jobs j ON j.id = e.job_id "
            "WHERE e.host = :h AND e.ended_at IS NULL AND j.payload ? 'seconds'",
            h=host,
        )
    )


@pytest.mark.timeout(300)
def test_f13_many_hosts_through_one_pgbouncer(
    make_world: Callable[..., World], request: pytest.FixtureRequest
) -> None:
    title = "3 worker hosts + 1 enqueuing, one PgBouncer: one killed, one cut 15 s"
    reason = cannot_make_namespaces()
    if reason:
        report().add(Row("F13", title, outcome="skipped", notes=reason))
        pytest.skip(reason)
    world = make_world()
    svc = world.services
    database = svc.database_url.rsplit("/", 1)[1]
    # What the README tells a pooled deployment to do: timeouts on the database, not the session
    # (a cut host's session idle in transaction would otherwise hold its rows' locks for good).
    with svc.admin() as admin:
        admin.execute(
            f'ALTER DATABASE "{database}" SET idle_in_transaction_session_timeout = '
            f"'{TIMEOUT_ROLE}'"
        )
    bouncer = PgBouncer("127.0.0.1", svc.pg_port)
    api_port = int(world.url.rsplit(":", 1)[1].split("/", 1)[0])
    enqueuer: subprocess.Popen[bytes] | None = None
    try:
        with (
            network((*WORKERS, "host-d")) as net,
            relay(net, [bouncer.port, svc.redis_port, api_port]),
        ):
            pooled = {"HARVEST_DATABASE_POOLER": "transaction"}
            local = {**pooled, "HARVEST_DATABASE_URL": bouncer.url(database)}
            remote = {
                **pooled,
                "HARVEST_DATABASE_URL": bouncer.url(database).replace("127.0.0.1", net.address),
                "HARVEST_REDIS_URL": svc.redis_url.replace("127.0.0.1", net.address),
            }
            url = world.url.replace("127.0.0.1", net.address)
            world.cluster.worker("schedule", concurrency=1, **local)
            world.cluster.beat(**local)
            procs = {
                host: world.cluster.worker(
                    "execution", concurrency=2, netns=net.hosts[host], CHAOS_HOST=host, **remote
                )
                for host in WORKERS
            }
            world.cluster.wait_ready()
            with (world.cluster.log_dir / "enqueuer.log").open("wb") as errors:
                enqueuer = subprocess.Popen(
                    ["ip", "netns", "exec", net.hosts["host-d"], sys.executable, "-m",
                     "tests.chaos.enqueuer", url, str(BATCHES), str(SIZE), str(EVERY)],
                    cwd=ROOT,
                    env={**world.cluster.env, **remote, "PYTHONPATH": str(ROOT)},
                    stdout=subprocess.PIPE,
                    stderr=errors,
                )  # fmt: skip
            start = time.time()
            wait_until(
                lambda: all(executions_on(world, host, start) >= 3 for host in WORKERS),
                60,
                0.2,
                "every worker host to run jobs",
            )
            # Host A dies: its worker and children at once (their process group).
            wait_until(lambda: _running_long_job(world, "host-a"), 60, 0.1, "A on a long job")
            os.killpg(procs["host-a"].pid, signal.SIGKILL)
            killed_at = time.monotonic()
            time.sleep(0.3)
            killed = victims_of(world, killed_at, host="host-a")
            # Host B is cut off while it runs a long job, then healed.
            wait_until(lambda: _running_long_job(world, "host-b"), 60, 0.1, "B on a long job")
            net.cut("host-b")
            cut_at = time.monotonic()
            time.sleep(0.5)  # what host B had started before the cut is all it ever logged
            cut = victims_of(world, cut_at, host="host-b")
            while time.monotonic() - cut_at < CUT_SECONDS:
                note_rescues(world, killed + cut)
                time.sleep(0.2)
            net.heal("host-b")
            healed_at = time.time()
            rescued_in_cut = [v.rescued_after for v in cut if v.rescued_after is not None]
            out, _ = enqueuer.communicate(timeout=BATCHES * EVERY + 60)
            ids = [int(i) for line in out.decode().splitlines() for i in line.split()]
            enqueued_rc = enqueuer.returncode
            rejoined = wait_until(
                lambda: executions_on(world, "host-b", healed_at), 60, 0.5, "host B to rejoin"
            )
            world.wait_done(ids, 120)
            note_rescues(world, killed + cut)
            time.sleep(2.0)  # host B's stale handlers come back and try to write
            peak_clients = bouncer.clients()
    finally:
        if enqueuer is not None and enqueuer.poll() is None:
            enqueuer.kill()
        errors_seen = pooler_errors(bouncer.log, *world.cluster.log_of.values())
        bouncer.stop()
        with svc.admin() as admin:
            admin.execute(f'ALTER DATABASE "{database}" RESET idle_in_transaction_session_timeout')
    figures = world.figures(ids)
    stored = int(world.scalar("SELECT count(*) FROM harvest_jobs_all"))
    interrupted = killed + cut
    # An interrupted attempt never commits its effect (its execution row ends in the same
    # transaction): the effect, if any, is a later attempt's, from whichever host ran it.
    effects_by = dict(
        world.sql(
            "SELECT host, count(*) FROM chaos_effects WHERE job_id = ANY(:ids) GROUP BY host",
            ids=[v.job_id for v in interrupted],
        )
    )
    stale_effects = int(
        world.scalar(
            "SELECT count(*) FROM chaos_effects e JOIN unnest(:ids, :attempts) AS v(id, a) "
            "ON e.job_id = v.id AND e.attempt = v.a",
            ids=[v.job_id for v in interrupted],
            attempts=[v.attempt for v in interrupted],
        )
    )
    recovery = [v.rescued_after for v in interrupted if v.rescued_after is not None]
    record(
        "F13",
        title,
        request,
        jobs=len(ids),
        **figures.row(),
        worst_recovery=max(recovery, default=None),
        overlaps=world.overlaps(),
        notes=(
            f"netns hosts A, B, C (a worker of 2 processes each) and D (enqueues {SIZE} jobs "
            f"every {EVERY:g} s), schedule worker and beat on the machine, all through one "
            f"PgBouncer (transaction mode, {POOL_SIZE} server connections); host A SIGKILLed "
            f"with {len(killed)} jobs running, host B cut {CUT_SECONDS:g} s with {len(cut)} "
            f"({len(rescued_in_cut)} taken back during the cut, worst recovery shown); B ran "
            f"jobs again after the heal ({rejoined} since); effects of the interrupted jobs "
            f"written by {', '.join(sorted(effects_by)) or 'none'}; host D's {len(ids)} jobs all "
            f"stored ({stored}); {peak_clients} PgBouncer clients at the end; pooler errors in "
            f"any log: {len(errors_seen)}; "
            f"{figures.summary()}"
        ),
    )
    assert enqueued_rc == 0, "host D's enqueuer failed (see enqueuer.log)"
    assert len(ids) == BATCHES * SIZE == stored, "an enqueued job is missing"
    assert killed and cut, "host A or B ran nothing when it was hit"
    assert all(v.rescued_after is not None for v in interrupted), "a job was not taken back"
    assert stale_effects == 0, "an interrupted attempt's effect was committed"
    assert not errors_seen, errors_seen[:5]
    assert figures.lost == 0 and figures.statuses == {"succeeded": len(ids)}
    assert figures.duplicate_effects == 0 and figures.double_claims == 0
    assert world.overlaps() == 0
