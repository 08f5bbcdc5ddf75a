"""The receive state machine shared by both ends of every transport.

:class:`FrameProtocol` is an ``asyncio.BufferedProtocol``: the transport asks
it for a buffer and fills it. Between frames that buffer is the 88-byte header
area; once a header is parsed, the subclass names the payload's destination
(the caller's read buffer on the client, ``store.alloc(n)`` on the server) and
the transport writes the payload straight into it. No intermediate ``bytes``.
The shm and rdma transports drive the same object through the same two
methods, so framing exists once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from tierfs.errors import ProtocolError
from tierfs.net.protocol import HEADER_SIZE, Header, Limits, crc32c, decode_header

__all__ = ["FrameProtocol", "log"]

log = logging.getLogger("tierfs.net")

_DISCARD_CHUNK = 1 << 16


class FrameProtocol(asyncio.BufferedProtocol):
    """Frame reassembly; subclasses implement :meth:`_on_header` and
    :meth:`_on_frame` (and may override the connection hooks)."""

    #: "client" or "server", for logs.
    role = "peer"

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.transport: Any = None
        self.peer = "?"
        self.closed = False
        self._hdr = bytearray(HEADER_SIZE)
        self._hdr_view = memoryview(self._hdr)
        self._hdr_fill = 0
        self._cur: Header | None = None
        self._payload: memoryview | None = None
        # A scattered payload (see _on_header): the part after _payload, and
        # the first part once it is complete.
        self._tail: memoryview | None = None
        self._first: memoryview | None = None
        self._payload_fill = 0
        self._crc = 0
        self._discard_left = 0
        self._scratch: memoryview | None = None

    # --- transport callbacks -------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = str(peer) if peer is not None else transport.get_extra_info("tierfs_peer", "?")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                n = self.limits.socket_buffer_bytes
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, n)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, n)
            except OSError:  # pragma: no cover - best effort tuning
                pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._on_lost(exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._cur is None:
            return self._hdr_view[self._hdr_fill:]
        if self._payload is not None:
            return self._payload[self._payload_fill:]
        scratch = self._scratch
        if scratch is None:
            scratch = self._scratch = memoryview(bytearray(_DISCARD_CHUNK))
        return scratch[: min(_DISCARD_CHUNK, self._discard_left)]

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        cur = self._cur
        if cur is None:
            self._hdr_fill += nbytes
            if self._hdr_fill < HEADER_SIZE:
                return
            self._hdr_fill = 0
            try:
                cur = decode_header(self._hdr, self.limits.max_frame_bytes)
                if cur.payload_len == 0:
                    self._on_frame(cur, None)
                    return
                dest = self._on_header(cur)
            except ProtocolError as exc:
                self.violation(str(exc))
                return
            self._cur = cur
            if dest is None:
                self._discard_left = cur.payload_len
            else:
                tail: memoryview | None = None
                if isinstance(dest, tuple):
                    dest, tail = dest
                    if not len(dest):
                        dest, tail = tail, None
                if len(dest) + (len(tail) if tail is not None else 0) != cur.payload_len:  # pragma: no cover - subclass bug
                    self.violation("payload buffer has the wrong size")
                    return
                self._payload = dest
                self._tail = tail
                self._first = None
                self._payload_fill = 0
                self._crc = 0
            return
        if self._payload is None:
            self._discard_left -= nbytes
            if self._discard_left == 0:
                self._cur = None
                try:
                    self._on_frame(cur, None)
                except ProtocolError as exc:
                    self.violation(str(exc))
            return
        payload = self._payload
        # CRC each piece as it lands, while it is still in cache.
        self._crc = crc32c(payload[self._payload_fill:self._payload_fill + nbytes], self._crc)
        self._payload_fill += nbytes
        if self._payload_fill < len(payload):
            return
        if self._tail is not None:
            self._first, self._payload, self._tail = payload, self._tail, None
            self._payload_fill = 0
            return
        if self._first is not None:
            payload, self._first = self._first, None
        self._cur = None
        self._payload = None
        got = self._crc
        if got != cur.payload_crc:
            self._on_bad_payload(cur, payload)
            self.violation(f"payload CRC mismatch on request {cur.request_id}: {got:#010x} != {cur.payload_crc:#010x}")
            return
        try:
            self._on_frame(cur, payload)
        except ProtocolError as exc:
            self.violation(str(exc))

    def eof_received(self) -> bool | None:
        return None

    # --- helpers ---------------------------------------------------------------

    @property
    def receiving(self) -> Header | None:
        """The frame whose payload is being received right now, if any."""
        return self._cur

    def violation(self, reason: str) -> None:
        """Close the connection for a protocol violation, with a logged reason."""
        if self.closed:
            return
        log.warning(
            "dataplane connection closed: %s", reason,
            extra={"event": "dataplane.protocol_violation", "role": self.role,
                   "peer": self.peer, "reason": reason},
        )
        self._on_violation(reason)
        self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # --- subclass hooks --------------------------------------------------------

    def _on_header(self, hdr: Header) -> memoryview | tuple[memoryview, memoryview] | None:
        """Where the payload of ``hdr`` goes (exactly ``payload_len`` bytes),
        or None to discard it. Raise ProtocolError to drop the connection.

        A pair scatters the payload: its first ``len(first)`` bytes land in
        ``first``, the rest in ``second`` (a KV put: the value into a store
        buffer, the key after it into a small one). ``_on_frame`` and
        ``_on_bad_payload`` then get ``first``; the subclass keeps ``second``."""
        raise NotImplementedError

    def _on_frame(self, hdr: Header, payload: memoryview | None) -> None:
        raise NotImplementedError

    def _on_bad_payload(self, hdr: Header, payload: memoryview) -> None:
        """A payload failed its CRC: give back its buffer."""

    def _on_violation(self, reason: str) -> None:
        """Count it."""

    def _on_lost(self, exc: Exception | None) -> None:
        """Clean up after the connection is gone."""
