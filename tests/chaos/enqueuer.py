"""F13's enqueuing host: ``python -m tests.chaos.enqueuer URL BATCHES SIZE EVERY``.

Enqueues ``BATCHES`` batches of ``SIZE`` ``chaos.work`` jobs, one batch every ``EVERY`` seconds,
through whatever the environment's ``HARVEST_DATABASE_URL`` says (in F13: PgBouncer, reached
across the test's network from another namespace), the way a user's producer would: the public
``Harvest`` client and ``enqueue_many``. Every tenth job works 3 s instead of 20-200 ms, so a
host is surely mid-job when it is cut. Prints each batch's job ids as one line; any error ends
the process with a traceback and a non-zero status (the test then fails).
"""

from __future__ import annotations

import sys
import time

from harvest import Harvest


def main() -> None:
    url, batches, size, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    client = Harvest()
    client.load_imports(["tests.chaos.jobs"])
    start = time.monotonic()
    n = 0
    for batch in range(batches):
        payloads = []
        for _ in range(size):
            payloads.append({"url": url, "seconds": 3.0} if n % 10 == 9 else {"url": url})
            n += 1
        ids = client.enqueue_many("chaos.work", payloads)
        print(" ".join(map(str, ids)), flush=True)
        time.sleep(max(0.0, start + (batch + 1) * every - time.monotonic()))
    client.close()


if __name__ == "__main__":
    main()
