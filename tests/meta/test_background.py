"""BackgroundLoop: the start/stop of the leader's planners (KVPlanner,
Rebalancer)."""

from __future__ import annotations

import asyncio

from tierfs.meta.background import BackgroundLoop
from tierfs.meta.kvplan import KVPlanner
from tierfs.meta.rebalance import Rebalancer


class Ticker(BackgroundLoop):
    task_name = "test-ticker"

    def __init__(self) -> None:
        self.rounds = 0
        self.cancelled = False

    async def _loop(self) -> None:
        try:
            while True:
                self.rounds += 1
                await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def _wait(cond: object, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.001)


def test_one_task_started_and_stopped() -> None:
    asyncio.run(_started_and_stopped())


async def _started_and_stopped() -> None:
    t = Ticker()
    t.start()
    first = t._task
    t.start()  # a second start does nothing
    assert t._task is first and first is not None
    assert first.get_name() == "test-ticker"
    await _wait(lambda: t.rounds >= 3)
    await t.stop()
    assert t.cancelled and first.done() and t._task is None
    rounds = t.rounds
    await asyncio.sleep(0.01)
    assert t.rounds == rounds  # nothing runs after stop
    await t.stop()  # a second stop does nothing
    t.start()  # and it can start again
    assert t._task is not None and t._task is not first
    await t.stop()


def test_planners_use_it() -> None:
    assert issubclass(KVPlanner, BackgroundLoop) and KVPlanner.task_name == "meta-kvplan"
    assert issubclass(Rebalancer, BackgroundLoop) and Rebalancer.task_name == "meta-rebalance"
