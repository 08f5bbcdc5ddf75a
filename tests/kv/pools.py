"""KV pool helpers shared by the cluster tests (tests/kv) and the engine
tests (tests/engines): define a pool, and wait until every storage daemon
serves it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from tierfs.meta import MetaClient


def wait_for(cond: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    end = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def define_pool(meta: Sequence[str], name: str, **kw: Any) -> None:
    async def go() -> None:
        async with MetaClient(list(meta)) as mc:
            await mc.create_kv_pool(name, **kw)
    asyncio.run(go())


def pool_served(meta: Sequence[str], name: str, timeout: float = 30.0) -> None:
    """Wait until pool ``name`` has groups in the map and every storage
    daemon serves it (reports usage for it: it configured it from the map)."""
    async def served() -> bool:
        async with MetaClient(list(meta)) as mc:
            r = await mc.list_kv_pools()
        pool = next((p for p in r.pools if p.name == name), None)
        if pool is None or not pool.groups:
            return False
        members = {t for g in pool.groups for t in g.target_ids}
        return members <= {u.target_id for u in r.usage if u.pool_id == pool.pool_id}
    wait_for(lambda: asyncio.run(served()), timeout, f"KV pool {name} to be served")
