"""Small asyncio helpers shared by the daemons."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], *, swallow: bool = False) -> None:
    """Cancel ``tasks`` and wait until every one has ended, cancelling again
    those still running: Python 3.11's ``asyncio.wait_for`` swallows a
    cancel that lands just as the wait it wraps completes (a loop's wake-up
    event set at that moment), and a loop sleeping in it goes on for
    another round. A single cancel left a meta replica's stop hanging (1
    stop in 4 in ``tests/meta/test_meta_robustness.py``, stop 52).
    ``swallow``: an exception a task ended with is dropped, not raised."""
    tasks = list(tasks)
    pending = [t for t in tasks if not t.done()]
    while pending:
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=0.1)
        pending = [t for t in pending if not t.done()]
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, *((Exception,) if swallow else ())):
            await t
