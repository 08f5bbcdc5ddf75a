"""The transport interface: how frames get between two processes.

A transport connects a client-side and a server-side :class:`FrameProtocol`.
What it hands the protocol is asyncio-transport shaped (``write``,
``writelines``, ``get_write_buffer_size``, ``set_write_buffer_limits``,
``pause_reading``, ``resume_reading``, ``close``, ``abort``) and it drives the
protocol through ``get_buffer``/``buffer_updated`` and
``pause_writing``/``resume_writing``, so the framing and request logic above
it is the same for tcp, shm and rdma. Transports are looked up by name with
:func:`get_transport`; optional ones import their dependencies lazily.
"""

from __future__ import annotations

import abc
import ssl
from collections.abc import Callable
from typing import ClassVar

from tierfs.errors import ConfigError
from tierfs.net.framing import FrameProtocol
from tierfs.net.protocol import Limits

__all__ = ["Listener", "ProtocolFactory", "Transport", "get_transport", "transport_names"]

ProtocolFactory = Callable[[], FrameProtocol]


class Listener(abc.ABC):
    """A bound server endpoint."""

    #: What a client passes to :meth:`Transport.connect` (besides host/port).
    address: str

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop accepting; existing connections are closed by the server."""


class Transport(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    async def connect(
        self, host: str, port: int, factory: ProtocolFactory, *, limits: Limits, timeout: float
    ) -> FrameProtocol:
        """Open one connection to the data-plane server at (host, port) and
        return its connected protocol. Raises UnavailableError."""

    @abc.abstractmethod
    async def listen(self, host: str, port: int, factory: ProtocolFactory, *, limits: Limits) -> Listener:
        """Serve ``factory`` connections for the server whose TCP port is
        ``port`` (0: pick one; tcp only)."""

    @classmethod
    def available(cls) -> bool:
        """Whether this transport can run on this machine."""
        return True


def _registry() -> dict[str, type[Transport]]:
    from tierfs.net.rdma import RdmaTransport
    from tierfs.net.shm import ShmTransport
    from tierfs.net.tcp import TcpTransport

    return {"tcp": TcpTransport, "shm": ShmTransport, "rdma": RdmaTransport}


def transport_names() -> list[str]:
    return list(_registry())


def get_transport(name: str, *, tls: ssl.SSLContext | None = None) -> Transport:
    """A transport by name. ``tls``: the TLS context of a tcp transport
    (server or client side); shm and rdma never leave the host or the
    fabric and ignore it (docs/security-tls.md)."""
    cls = _registry().get(name)
    if cls is None:
        raise ConfigError(f"unknown transport {name!r} (known: {', '.join(_registry())})", field="transport")
    if name == "tcp":
        from tierfs.net.tcp import TcpTransport

        return TcpTransport(tls)
    return cls()
