"""BackgroundLoop.stop: the loop task ends even when a cancel lands as the
wait it sleeps in completes (Python 3.11's asyncio.wait_for swallows such a
cancel; a meta replica asked to stop waited out a whole rebalance interval,
1 stop in 4 in tests/meta/test_meta_robustness.py)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tierfs.meta.background import BackgroundLoop

pytestmark = pytest.mark.timeout(30)


class _Loop(BackgroundLoop):
    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.rounds = 0

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), 60)
            self.wake.clear()
            self.rounds += 1


@pytest.mark.parametrize("spins", range(6))
def test_stop_ends_the_loop_when_a_wake_up_meets_the_cancel(spins: int) -> None:
    async def main() -> None:
        lp = _Loop()
        lp.start()
        await asyncio.sleep(0.01)  # in its wait
        lp.wake.set()
        for _ in range(spins):  # the cancel lands at each step of the wake-up
            await asyncio.sleep(0)
        task = lp._task
        assert task is not None
        stopping = asyncio.ensure_future(lp.stop())
        done, _ = await asyncio.wait({stopping}, timeout=5)  # the interval is 60 s
        assert done and task.done(), "stop() did not end the loop"
        await stopping

    asyncio.run(main())
