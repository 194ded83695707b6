"""What a GIN (jsonb_path_ops) index on harvest_jobs.payload costs every enqueue: single
enqueues (one transaction each) and bulk enqueue_many, with and without the index, alternated
in the same run on a private database (the machine may be loaded: compare rounds, not runs).

    python -m bench.gin_cost [--single 400] [--bulk 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time

import psycopg
from sqlalchemy import text

from harvest import migrate
from harvest.app import Harvest
from harvest.context import JobContext
from harvest.settings import Settings

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
INDEX = (
    "CREATE INDEX IF NOT EXISTS harvest_jobs_payload_idx "
    "ON harvest_jobs USING gin (payload jsonb_path_ops)"
)


def _payload(i: int) -> dict[str, object]:
    url = f"https://example.org/articles/{i}?ref=feed"
    tags = ["news", f"t{i % 50}"]
    return {"url": url, "n": i, "lang": "en", "tags": tags, "meta": {"source": f"s{i % 7}"}}


def _single(app: Harvest, n: int, start: int) -> float:
    began = time.perf_counter()
    for i in range(start, start + n):
        app.enqueue("fetch", _payload(i), delay=3600)  # delayed: no dispatch nudge
    return (time.perf_counter() - began) / n * 1e6  # microseconds per job


def _bulk(app: Harvest, n: int, start: int) -> float:
    began = time.perf_counter()
    app.enqueue_many("fetch", [_payload(i) for i in range(start, start + n)], delay=3600)
    return (time.perf_counter() - began) / n * 1e6


_SQL_INSERT = text(
    """
    INSERT INTO harvest_jobs (name, payload, run_at)
    SELECT 'fetch', jsonb_build_object(
        'url', 'https://example.org/articles/' || (i + :start) || '?ref=feed', 'n', i + :start,
        'lang', 'en', 'tags', jsonb_build_array('news', 't' || (i % 50)),
        'meta', jsonb_build_object('source', 's' || (i % 7))),
        now() + interval '1 hour'
    FROM generate_series(1, :n) AS i
    """
)


def _sql(app: Harvest, n: int, start: int) -> float:
    """The insert alone, in Postgres (no Python encoding, no checks): the index's share shows."""
    with app.engine.begin() as conn:
        began = time.perf_counter()
        conn.execute(_SQL_INSERT, {"n": n, "start": start})
        return (time.perf_counter() - began) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--single", type=int, default=400)
    parser.add_argument("--bulk", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    name = f"harvest_gin_{secrets.token_hex(4)}"
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        settings = Settings(
            database_url=f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}",
            redis_url="redis://127.0.0.1:6379/14",
            max_queue_depth=10_000_000,
        )
        migrate.upgrade(settings, "head")
        app = Harvest(settings)

        @app.job("fetch")
        def fetch(ctx: JobContext, url: str, n: int, lang: str, tags: list[str],
                  meta: dict[str, object]) -> None: ...  # fmt: skip

        results: dict[bool, dict[str, list[float]]] = {
            False: {"single": [], "bulk": [], "sql": []},
            True: {"single": [], "bulk": [], "sql": []},
        }  # fmt: skip
        start = 0
        for r in range(args.rounds):
            for indexed in (False, True) if r % 2 == 0 else (True, False):
                with app.engine.begin() as conn:
                    conn.execute(text("DROP INDEX IF EXISTS harvest_jobs_payload_idx"))
                    if indexed:
                        conn.execute(text(INDEX))
                results[indexed]["single"].append(_single(app, args.single, start))
                start += args.single
                results[indexed]["bulk"].append(_bulk(app, args.bulk, start))
                start += args.bulk
                results[indexed]["sql"].append(_sql(app, args.bulk, start))
                start += args.bulk
        for indexed in (False, True):
            print(f"{'with' if indexed else 'without'} GIN (µs per job; median, then each round):")
            for kind, values in results[indexed].items():
                shown = ", ".join(f"{v:.1f}" for v in values)
                print(f"  {kind:>6}: {statistics.median(values):8.1f}   [{shown}]")
        app.close()
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
