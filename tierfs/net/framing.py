"""The receive state machine shared by both ends of every transport.

:class:`FrameProtocol` is an ``asyncio.BufferedProtocol``: the transport asks
it for a buffer and fills it. Between frames that buffer is the 88-byte header
area; once a header is parsed, the subclass names the payload's destination
(the caller's read buffer on the client, ``store.alloc(n)`` on the server) and
the transport writes the payload straight into it. No intermediate ``bytes``.
The shm and rdma transports drive the same object through the same two
methods, so framing exists once.

Off the loop. One event loop thread receives everything a client gets, and
on a many-core GPU host it was the limit: checking each payload's CRC32C
and (shm) copying it out of the ring took about 40% of that thread. A
protocol whose ``offload_min`` is set (the client's, from
``Limits.offload_min_bytes``) hands a payload of at least that size to
worker threads instead: the shm transport copies it out of the ring there
(:meth:`FrameProtocol.add_copy` tells the protocol of each copy), and once
every byte has landed the CRC is computed there too. The frame is delivered
(``_on_frame``) only after the check passes, exactly as before; meanwhile
the loop parses and receives the frames behind it. ``crc32c`` and
``ctypes.memmove`` release the GIL, so the workers run in parallel with
the loop. Answers may then complete out of order, which a client does not
mind (each has its own request id).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import os
import socket
import threading
from typing import Any

from tierfs.errors import ProtocolError
from tierfs.net.protocol import HEADER_SIZE, Header, Limits, crc32c, decode_header, usable_cpus

__all__ = ["FrameProtocol", "log"]

log = logging.getLogger("tierfs.net")

_DISCARD_CHUNK = 1 << 16

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_PID = 0
_POOL_LOCK = threading.Lock()


def offload_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process's worker threads for payload checks and ring copies
    (made at first use; again in a forked child, whose copy has no threads)."""
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or os.getpid() != _POOL_PID:
            workers = max(2, min(8, usable_cpus() - 1))
            _POOL = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tierfs-rx")
            _POOL_PID = os.getpid()
        return _POOL


def memmove(dest: memoryview, src: memoryview) -> None:
    """``dest[:] = src`` without holding the GIL (both writable, same length)."""
    n = len(src)
    if n:
        ctypes.memmove((ctypes.c_char * n).from_buffer(dest), (ctypes.c_char * n).from_buffer(src), n)


class FrameProtocol(asyncio.BufferedProtocol):
    """Frame reassembly; subclasses implement :meth:`_on_header` and
    :meth:`_on_frame` (and may override the connection hooks)."""

    #: "client" or "server", for logs.
    role = "peer"
    #: Payloads of at least this many bytes are copied (shm) and checked on
    #: worker threads (see "Off the loop" above); 0: never.
    offload_min = 0

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
        # The payload being received is checked off the loop, and the
        # copies of its pieces still running there (see "Off the loop").
        self._deferred = False
        self._copies: list[asyncio.Future[Any]] = []
        # Copies into a caller's buffer not yet known done, by request id:
        # waited for before a caller is told its request failed (settle_copies).
        self._landing: dict[int, list[concurrent.futures.Future[Any]]] = {}

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
        self.settle_copies()
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
                self._deferred = 0 < self.offload_min <= cur.payload_len and tail is None
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
        if not self._deferred:
            # CRC each piece as it lands, while it is still in cache.
            self._crc = crc32c(payload[self._payload_fill:self._payload_fill + nbytes], self._crc)
        self._payload_fill += nbytes
        if self._payload_fill < len(payload):
            return
        if self._deferred:
            copies, self._copies = self._copies, []
            self._deferred = False
            self._cur = None
            self._payload = None
            self._check_later(cur, payload, copies)
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

    # --- off the loop ----------------------------------------------------------

    @property
    def deferring(self) -> bool:
        """The payload being received is copied and checked off the loop: a
        transport may copy its pieces on worker threads (:meth:`add_copy`)."""
        return self._deferred

    def add_copy(self, fut: concurrent.futures.Future[Any]) -> asyncio.Future[Any]:
        """A piece of the current payload is being copied into its buffer by
        ``fut`` (on a worker); the payload is checked only after it is done.
        Returns ``fut`` as an asyncio future of the running loop."""
        assert self._cur is not None
        self._landing.setdefault(self._cur.request_id, []).append(fut)
        wrapped = asyncio.wrap_future(fut)
        self._copies.append(wrapped)
        return wrapped

    def settle_copies(self, request_id: int | None = None) -> None:
        """Block until every copy still running into the buffer of
        ``request_id`` (None: of any request) is done, so that no byte lands
        in a caller's buffer after its call has returned. Copies are a few
        milliseconds at most, and this runs only when a request fails."""
        ids = list(self._landing) if request_id is None else [request_id]
        for rid in ids:
            fs = self._landing.pop(rid, None)
            if fs:
                concurrent.futures.wait(fs)

    def _check_later(self, cur: Header, payload: memoryview, copies: list[asyncio.Future[Any]]) -> None:
        loop = asyncio.get_running_loop()

        def start(_: Any = None) -> None:
            self._landing.pop(cur.request_id, None)
            if self.closed:
                return
            for c in copies:
                if c.cancelled() or c.exception() is not None:
                    self.violation(f"payload copy for request {cur.request_id} failed: "
                                   f"{'cancelled' if c.cancelled() else repr(c.exception())}")
                    return
            loop.run_in_executor(offload_pool(), crc32c, payload).add_done_callback(checked)

        def checked(f: asyncio.Future[int]) -> None:
            if self.closed:
                return
            if f.cancelled() or f.exception() is not None:
                self.violation(f"payload check for request {cur.request_id} failed: "
                               f"{'cancelled' if f.cancelled() else repr(f.exception())}")
                return
            got = f.result()
            if got != cur.payload_crc:
                if self._forget(cur):
                    return
                self._on_bad_payload(cur, payload)
                self.violation(f"payload CRC mismatch on request {cur.request_id}: {got:#010x} != "
                               f"{cur.payload_crc:#010x}")
                return
            try:
                self._on_frame(cur, payload)
            except ProtocolError as exc:
                self.violation(str(exc))

        if copies:
            asyncio.gather(*copies, return_exceptions=True).add_done_callback(start)
        else:
            start()

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

    def _forget(self, hdr: Header) -> bool:
        """A payload checked off the loop failed its CRC: True if no one
        waits for it any more (its caller gave up and may have written into
        the buffer meanwhile), so that it is dropped and the connection kept."""
        return False

    def _on_violation(self, reason: str) -> None:
        """Count it."""

    def _on_lost(self, exc: Exception | None) -> None:
        """Clean up after the connection is gone."""
