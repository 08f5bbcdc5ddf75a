"""Bounded fan-out that keeps order.

``ordered(factories, limit)`` runs at most ``limit`` coroutines at once and
returns their results in the order of ``factories``, a failure in its own
slot (so a caller such as the decoder can use whichever of them succeeded).
Only TierFS errors are caught into slots; anything else (a bug, a
cancellation) cancels the rest and propagates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from tierfs.errors import TierFSError

__all__ = ["first_error", "ordered"]

T = TypeVar("T")


async def ordered(factories: Sequence[Callable[[], Awaitable[T]]], limit: int) -> list[T | TierFSError]:
    n = len(factories)
    out: list[T | TierFSError | None] = [None] * n
    if n == 0:
        return []
    nxt = 0

    async def worker() -> None:
        nonlocal nxt
        while nxt < n:
            i = nxt
            nxt += 1
            try:
                out[i] = await factories[i]()
            except TierFSError as exc:
                out[i] = exc

    workers = [asyncio.ensure_future(worker()) for _ in range(min(limit, n))]
    try:
        await asyncio.gather(*workers)
    except BaseException:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        raise
    return out  # type: ignore[return-value]


def first_error(results: Sequence[object]) -> TierFSError | None:
    for r in results:
        if isinstance(r, TierFSError):
            return r
    return None
