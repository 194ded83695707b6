"""Running jobs inside an execution worker.

The decisions are made once, in pure code with no I/O (:mod:`harvest.execution.outcome`: what an
attempt's outcome is, how long until its retry, what its fenced write carries). The shells
around them only do I/O: a blocking one for sync handlers (prefork, threads, gevent) and an
asyncio one for ``async def`` handlers.
"""
