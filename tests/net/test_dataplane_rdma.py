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
