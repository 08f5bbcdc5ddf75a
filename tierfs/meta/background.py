"""One background task per object, started and stopped with the leader's
service: the pattern of :class:`tierfs.meta.kvplan.KVPlanner` and
:class:`tierfs.meta.rebalance.Rebalancer`."""

from __future__ import annotations

import asyncio

from tierfs.aio import cancel_and_wait


class BackgroundLoop:
    """Mixin: :meth:`start` runs ``self._loop()`` as one named task (a second
    call does nothing), :meth:`stop` cancels it and waits for it to end."""

    #: the task's name (asyncio debugging, py-spy)
    task_name = "meta-background"
    _task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=self.task_name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait([task])  # cancelled again until done (tierfs.aio)
