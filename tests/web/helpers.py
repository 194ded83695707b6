"""Small helpers shared by the web tests (the database's own view, to compare pages with)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Engine, text


def end_as(engine: Engine, ids: Sequence[int], status: str, error: str | None = None) -> None:
    """Make jobs look ended (no worker needed): started when due, finished now."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE harvest_jobs SET status = :status, attempts = greatest(attempts, 1), "
                "started_at = run_at, finished_at = greatest(now(), run_at), "
                "last_error = :error, last_traceback = :tb WHERE id = ANY(:ids)"
            ),
            {
                "status": status,
                "ids": list(ids),
                "error": error,
                "tb": f"Traceback (most recent call last):\n  {error}" if error else None,
            },
        )


def db_depth(engine: Engine) -> dict[tuple[str, str], int]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT queue, status, count(*) FROM harvest_jobs GROUP BY queue, status")
        )
        return {(r[0], r[1]): int(r[2]) for r in rows}


def db_status(engine: Engine, job_id: int) -> str | None:
    with engine.connect() as conn:
        value = conn.execute(
            text("SELECT status FROM harvest_jobs WHERE id = :id"), {"id": job_id}
        ).scalar_one_or_none()
    return None if value is None else str(value)


def forget_logins(redis_url: str) -> None:
    """Clear the dashboard's login throttling state (failure counts and locks) in Redis."""
    import redis

    from harvest.coordination.keys import LOGIN_PREFIX

    client = redis.Redis.from_url(redis_url)
    try:
        names = list(
            client.scan_iter(match=LOGIN_PREFIX.replace("{", "\\{").replace("}", "\\}") + "*")
        )
        if names:
            client.delete(*names)
    finally:
        client.close()
