"""Usage accounting: requests, tokens, 429s and errors per key and pool, per minute, in Postgres,
without a write per call.

The execution core decides what one call counts as (:func:`tally.call`, pure) and yields it
(``CountUsage``) where it gives the key back; both shells add it to the process's
:class:`tally.Tally` (memory, no I/O). A :class:`flusher.Flusher` thread writes the tally every
``HARVEST_USAGE_FLUSH_INTERVAL`` seconds in one transaction (:mod:`rows`: one upsert adding to
the minute's row per key, one adding to the running totals). A process that dies loses at most
its unflushed window; a flush that fails keeps its counts for the next one (bounded).
"""

from harvest.usage.tally import Call, Tally, call

__all__ = ["Call", "Tally", "call"]
