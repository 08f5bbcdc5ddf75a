"""The data-plane client when its connection is lost while a batch's caller
is being cancelled: nothing is left for asyncio to report as "Future
exception was never retrieved" (a new user saw two such tracebacks at the
exit of a weights load with a storage daemon SIGKILLed; the data was right)."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from tierfs.net.client import _ClientConnection, _Req
from tierfs.net.protocol import Limits, Op
from tierfs.storage.api import FragmentKey

pytestmark = pytest.mark.timeout(30)


def test_a_batch_cancelled_as_its_connection_is_lost_leaves_no_unretrieved_error(
        caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        accepted: list[asyncio.StreamWriter] = []

        async def silent(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            accepted.append(w)  # reads nothing, answers nothing: a stalled daemon

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: _ClientConnection(Limits()), "127.0.0.1", port)
        reqs = [_Req(Op.READ, 1, FragmentKey(1, 0, j, 1), dest=memoryview(bytearray(4096))) for j in range(3)]
        task = asyncio.create_task(conn.call_many(reqs, timeout=20))
        while not conn.pending:
            await asyncio.sleep(0)
        # The connection is lost (another request of it was abandoned
        # mid-transfer, say) and, in the same turn of the loop, the batch's
        # caller is cancelled (its hedge was won by another copy).
        conn._on_lost(ConnectionResetError("reset by peer"))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        conn.transport.close()
        server.close()
        for w in accepted:
            w.close()
        await server.wait_closed()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text
