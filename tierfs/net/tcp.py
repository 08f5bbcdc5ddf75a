"""The default transport: TCP on the running (uvloop) event loop.

The protocol object is handed to ``loop.create_connection``/``create_server``
directly; uvloop recognises ``BufferedProtocol`` and ``recv``s into the buffer
the protocol names, so payloads land in their destination without a copy.
With an :class:`ssl.SSLContext` the same protocol runs over TLS (uvloop
decrypts into the protocol's buffer; one copy more, measured in
docs/security-tls.md): a server then speaks TLS only, and a client verifies
the server's certificate against the context's CA and the host it dialled.
"""

from __future__ import annotations

import asyncio
import ssl

from tierfs.errors import UnavailableError
from tierfs.net.framing import FrameProtocol
from tierfs.net.protocol import Limits
from tierfs.net.transport import Listener, ProtocolFactory, Transport
from tierfs.tls import RELOAD_CHECK_INTERVAL, refresh_ssl_context

__all__ = ["TcpListener", "TcpTransport"]


class TcpListener(Listener):
    def __init__(self, server: asyncio.Server, host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.address = f"{host}:{port}"
        # Renewed certificate files reach new connections (tierfs.tls).
        self._reload = asyncio.get_running_loop().create_task(self._reload_tls(tls)) if tls is not None else None

    @staticmethod
    async def _reload_tls(tls: ssl.SSLContext) -> None:
        while True:
            await asyncio.sleep(RELOAD_CHECK_INTERVAL)
            refresh_ssl_context(tls)

    async def close(self) -> None:
        if self._reload is not None:
            self._reload.cancel()
        self.server.close()
        await self.server.wait_closed()


#: A client that connects and never completes the TLS handshake (a
#: plaintext peer, a scanner) is dropped after this long.
TLS_HANDSHAKE_TIMEOUT = 10.0


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls = tls

    async def connect(
        self, host: str, port: int, factory: ProtocolFactory, *, limits: Limits, timeout: float
    ) -> FrameProtocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                if self.tls is None:
                    _, proto = await loop.create_connection(factory, host, port)
                else:
                    refresh_ssl_context(self.tls)  # renewed files (at most a stat per file per second)
                    _, proto = await loop.create_connection(factory, host, port, ssl=self.tls,
                                                            server_hostname=host)
        except (OSError, TimeoutError) as exc:
            over = "tcp+tls" if self.tls is not None else "tcp"
            raise UnavailableError(f"cannot connect to {host}:{port} over {over}: {exc or 'timeout'}") from None
        return proto

    async def listen(self, host: str, port: int, factory: ProtocolFactory, *, limits: Limits) -> Listener:
        loop = asyncio.get_running_loop()
        if self.tls is None:
            server = await loop.create_server(factory, host, port, reuse_address=True, backlog=1024)
        else:
            server = await loop.create_server(factory, host, port, reuse_address=True, backlog=1024, ssl=self.tls,
                                              ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT)
        bound = server.sockets[0].getsockname()[1]
        return TcpListener(server, host, int(bound), self.tls)
