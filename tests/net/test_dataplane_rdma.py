"""The rdma transport where it cannot run: it says so instead of failing
obscurely. (Its real conformance run is the ``rdma`` parameter of the shared
suite, skipped unless pyverbs and an RDMA device exist.)"""

from __future__ import annotations

import pytest
from dataplane_helpers import arun

from tierfs.errors import UnavailableError, UnsupportedError
from tierfs.net import DataClient, MemoryFragmentStore
from tierfs.net.rdma import RdmaTransport
from tierfs.storage.dataplane import start_dataplane

pytestmark = pytest.mark.skipif(RdmaTransport.available(), reason="an RDMA device exists: the suite covers it")


@pytest.mark.timeout(30)
def test_server_skips_rdma_and_client_reports_it() -> None:
    async def body() -> None:
        server = await start_dataplane({1: MemoryFragmentStore(1)}, transports=("tcp", "rdma"))
        try:
            assert list(server.listeners) == ["tcp"]
            async with DataClient(transport="rdma", routes={1: server.address}, connect_timeout=5) as c:
                with pytest.raises((UnavailableError, UnsupportedError)):
                    await c.ping(1)
        finally:
            await server.close()

    arun(body())


@pytest.mark.timeout(30)
def test_rdma_client_without_a_device_opens_no_socket_even_if_something_listens() -> None:
    """Seen with two test workers: another process listened on the server's
    rdma control port (port + CONTROL_PORT_OFFSET). The client connected to
    it, then found no RDMA device, left the socket open (a ResourceWarning)
    and retried for 30 s. Now it says "unsupported" before any socket."""
    import asyncio
    import time

    from tierfs.net.rdma import CONTROL_PORT_OFFSET

    async def body() -> None:
        server = await start_dataplane({1: MemoryFragmentStore(1)}, transports=("tcp",))
        accepted: list[asyncio.StreamWriter] = []

        async def stranger(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            accepted.append(w)

        port = int(server.address.rsplit(":", 1)[1])
        try:
            other = await asyncio.start_server(stranger, "127.0.0.1", port + CONTROL_PORT_OFFSET)
        except OSError:
            await server.close()
            pytest.skip(f"port {port + CONTROL_PORT_OFFSET} is taken here; the case needs it free")
        try:
            t0 = time.monotonic()
            async with DataClient(transport="rdma", routes={1: server.address}, connect_timeout=5) as c:
                with pytest.raises(UnsupportedError):
                    await c.ping(1)
            assert time.monotonic() - t0 < 5
            assert not accepted, "the client opened a control connection it could not use"
        finally:
            other.close()
            await other.wait_closed()
            await server.close()

    arun(body())
