"""The default transport: TCP on the running (uvloop) event loop.

The protocol object is handed to ``loop.create_connection``/``create_server``
directly; uvloop recognises ``BufferedProtocol`` and ``recv``s into the buffer
the protocol names, so payloads land in their destination without a copy.
"""

from __future__ import annotations

import asyncio

from tierfs.errors import UnavailableError
from tierfs.net.framing import FrameProtocol
from tierfs.net.protocol import Limits
from tierfs.net.transport import Listener, ProtocolFactory, Transport

__all__ = ["TcpListener", "TcpTransport"]


class TcpListener(Listener):
    def __init__(self, server: asyncio.Server, host: str, port: int) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()


class TcpTransport(Transport):
    name = "tcp"

    async def connect(
        self, host: str, port: int, factory: ProtocolFactory, *, limits: Limits, timeout: float
    ) -> FrameProtocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, proto = await loop.create_connection(factory, host, port)
        except (OSError, TimeoutError) as exc:
            raise UnavailableError(f"cannot connect to {host}:{port} over tcp: {exc or 'timeout'}") from None
        return proto

    async def listen(self, host: str, port: int, factory: ProtocolFactory, *, limits: Limits) -> Listener:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(factory, host, port, reuse_address=True, backlog=1024)
        bound = server.sockets[0].getsockname()[1]
        return TcpListener(server, host, int(bound))
