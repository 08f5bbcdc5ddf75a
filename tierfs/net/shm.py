"""Same-host transport: payload bytes move through shared memory.

Connection setup: the client connects to the server's abstract unix socket
``\\0tierfs-dp-<tcp port>``, creates two ``memfd`` rings (client->server and
server->client, ``Limits.shm_ring_bytes`` each) and passes their descriptors
with ``SCM_RIGHTS``. Nothing is left on any file system, and the rings vanish
with the last process that maps them.

Each ring is a byte stream: the sender copies the frames (header and payload)
into the ring at its write position and rings a doorbell on the unix socket
(``b"W" + u64 bytes written``); the receiver copies out of the ring straight
into the buffer the frame protocol names (the caller's read buffer, the
store's ``alloc`` buffer) and returns credit (``b"C" + u64 bytes consumed``).
So the socket carries only 9-byte doorbells; payloads cost one copy into the
ring and one out of it, no kernel socket copies. A sender whose ring is full
keeps the rest of its buffers (by reference) until credit comes back, which
is the transport's write buffer and its backpressure signal.

Hostile local peers (docs/dataplane.md, "shm and local peers"):

* a ring shrunk after it is mapped would kill the mapping process with
  SIGBUS at its next access, so the server accepts only memfds sealed with
  ``F_SEAL_SHRINK | F_SEAL_GROW`` (``F_GET_SEALS``; the client adds them,
  and ``F_SEAL_SEAL``, before sending). Seals can never be removed, so the
  size checked at the handshake is the size for good;
* both ends check the other's ``SO_PEERCRED``: the peer must run as the
  same uid or as root. A stranger cannot feed rings to the daemon, and a
  process squatting the abstract socket name cannot collect a client's rings;
* the server answers the hello (``TFSR``, ok flag, reason), so a refused
  client fails with the server's reason (:class:`ShmRefusedError`) instead
  of a bare hang-up.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import mmap
import os
import socket
import struct
from typing import Any

from tierfs.errors import UnavailableError
from tierfs.net.framing import FrameProtocol, log, memmove, offload_pool
from tierfs.net.protocol import Limits
from tierfs.net.transport import Listener, ProtocolFactory, Transport

__all__ = [
    "REQUIRED_SEALS", "ShmListener", "ShmRefusedError", "ShmTransport", "check_ring", "peer_uid", "socket_name",
]

_BELL = struct.Struct("<cQ")
_HELLO = struct.Struct("<4sQ")
_HELLO_MAGIC = b"TFSM"
_REPLY = struct.Struct("<4sBH")  # magic, 1 = accepted, length of the reason that follows
_REPLY_MAGIC = b"TFSR"
_MAX_REASON = 512
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: seals a ring must carry before the server maps it (a shrink would SIGBUS the mapper)
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_MIN_RING = 1 << 16
#: A piece of a deferred payload smaller than this is copied on the loop.
_OFFLOAD_PIECE = 64 << 10
_MAX_RING = 1 << 32


#: Listen addresses that name no one address: the server's shm name is then its port's alone.
_WILDCARD = frozenset({"", "0.0.0.0", "::", "[::]"})
#: The longest abstract unix socket name (sun_path less its leading NUL).
_MAX_NAME = 107


def socket_name(port: int, host: str = "") -> str:
    """Abstract unix socket name of the data-plane server on TCP ``port``.

    With ``host`` (the address the server listens on, the one a client
    dials), the name of that address's server: several daemons on one host,
    each on its own address with the same port (one per NIC, or hosts
    simulated on loopback addresses), have one each, where the port's name
    alone belongs to whichever bound it first (a client's shm connection to
    another of them reached that one, which did not serve its targets).
    A wildcard host, or a name too long for a socket address, gives the
    port's name."""
    if host not in _WILDCARD:
        name = f"\0tierfs-dp-{host}:{port}"
        if len(name.encode()) <= _MAX_NAME + 1:
            return name
    return f"\0tierfs-dp-{port}"


class _Bells(asyncio.Protocol):
    """The doorbell channel of one shm connection."""

    def __init__(self, owner: ShmStreamTransport) -> None:
        self.owner = owner
        self.buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.owner._bells = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        n = len(self.buf) - len(self.buf) % _BELL.size
        if not n:
            return
        wrote = credit = 0
        for kind, value in _BELL.iter_unpack(memoryview(self.buf)[:n]):
            if kind == b"W":
                wrote += value
            elif kind == b"C":
                credit += value
            else:
                self.owner._fail(f"bad doorbell {kind!r}")
                return
        del self.buf[:n]
        if credit:
            self.owner._on_credit(credit)
        if wrote:
            self.owner._on_written(wrote)

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner._on_bells_lost(exc)


class ShmStreamTransport(asyncio.Transport):
    """An asyncio-transport look-alike over a pair of shared-memory rings."""

    #: the receive ring is mapped here, so a worker thread may copy out of it
    _offload_copies = True

    def __init__(self, tx: mmap.mmap | None, rx: mmap.mmap | None, protocol: FrameProtocol, peer: str,
                 size: int = 0) -> None:
        super().__init__()
        self._loop = asyncio.get_running_loop()
        self._tx_map, self._rx_map = tx, rx
        self._tx = memoryview(tx) if tx is not None else memoryview(b"")
        self._rx = memoryview(rx) if rx is not None else memoryview(b"")
        self._size = len(tx) if tx is not None else size
        self._protocol = protocol
        self._peer = peer
        self._bells: asyncio.Transport | None = None
        # Sender: monotonic positions; ``_free`` is credit left in the peer's view.
        self._wpos = 0
        self._free = self._size
        self._queue: collections.deque[memoryview] = collections.deque()
        self._queued = 0
        self._high = 64 * 1024
        self._low = 16 * 1024
        self._write_paused = False
        # Receiver. ``_credited``: ring bytes handed back to the sender; the
        # bytes from the first copy still running on a worker are not
        # (``_copying``: (start, copy) in ring order; framing, "Off the loop").
        self._rpos = 0
        self._credited = 0
        self._copying: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()
        self._avail = 0
        self._reading_paused = False
        self._drain_scheduled = False
        self._closing = False
        self._lost = False

    # --- asyncio.Transport surface ---------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "tierfs_peer":
            return self._peer
        return default

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._bells is not None:
            self._bells.close()

    def abort(self) -> None:
        self._closing = True
        if self._bells is not None:
            self._bells.abort()

    def write(self, data: Any) -> None:
        self.writelines([data])

    def writelines(self, list_of_data: Any) -> None:
        if self._closing:
            return
        for data in list_of_data:
            view = memoryview(data).cast("B")
            if len(view):
                self._queue.append(view)
                self._queued += len(view)
        self._flush()

    def get_write_buffer_size(self) -> int:
        return self._queued

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high = 64 * 1024 if high is None else high
        self._low = self._high // 4 if low is None else low

    def pause_reading(self) -> None:
        self._reading_paused = True

    def resume_reading(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            self._schedule_drain()

    def is_reading(self) -> bool:
        return not self._reading_paused

    # --- sending -----------------------------------------------------------------

    def _flush(self) -> None:
        moved = 0
        size = self._size
        while self._queue and self._free:
            head = self._queue[0]
            pos = self._wpos % size
            n = min(len(head), self._free, size - pos)
            self._copy_in(pos, head[:n])
            self._wpos += n
            self._free -= n
            moved += n
            if n == len(head):
                self._queue.popleft()
            else:
                self._queue[0] = head[n:]
        if moved:
            self._queued -= moved
            assert self._bells is not None
            self._bells.write(_BELL.pack(b"W", moved))
        if not self._write_paused and self._queued > self._high:
            self._write_paused = True
            self._protocol.pause_writing()
        elif self._write_paused and self._queued <= self._low:
            self._write_paused = False
            self._protocol.resume_writing()

    def _on_credit(self, n: int) -> None:
        self._free += n
        if self._free > self._size:
            self._fail("peer returned more credit than it was given")
            return
        self._flush()

    def _copy_in(self, pos: int, data: memoryview) -> None:
        """Put ``data`` into the peer's ring at ``pos`` (shm: it is mapped here)."""
        self._tx[pos:pos + len(data)] = data

    def _copy_out(self, buf: memoryview, pos: int, n: int) -> None:
        buf[:n] = self._rx[pos:pos + n]

    # --- receiving ---------------------------------------------------------------

    def _on_written(self, n: int) -> None:
        self._avail += n
        if self._avail > self._size:
            self._fail("peer wrote more than the ring holds")
            return
        self._drain()

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        size, proto = self._size, self._protocol
        try:
            while self._avail and not self._reading_paused and not self._closing:
                buf = proto.get_buffer(-1)
                pos = self._rpos % size
                n = min(len(buf), self._avail, size - pos)
                if n <= 0:
                    raise RuntimeError("get_buffer returned an empty buffer")
                if self._offload_copies and proto.deferring and n >= _OFFLOAD_PIECE:
                    # The copy runs on a worker; its ring bytes are handed
                    # back once it is done (_return_credit).
                    copy = proto.add_copy(offload_pool().submit(memmove, buf[:n], self._rx[pos:pos + n]))
                    self._copying.append((self._rpos, copy))
                    copy.add_done_callback(self._copied)
                else:
                    self._copy_out(buf, pos, n)
                del buf
                self._rpos += n
                self._avail -= n
                proto.buffer_updated(n)
        except Exception as exc:
            self._fail(f"receive failed: {exc!r}")
            return
        finally:
            self._return_credit()

    def _copied(self, _: asyncio.Future[None]) -> None:
        self._return_credit()

    def _return_credit(self) -> None:
        copying = self._copying
        while copying and copying[0][1].done():
            copying.popleft()
        upto = copying[0][0] if copying else self._rpos
        n = upto - self._credited
        if n > 0 and self._bells is not None and not self._bells.is_closing():
            self._credited = upto
            self._bells.write(_BELL.pack(b"C", n))

    # --- teardown ----------------------------------------------------------------

    def _fail(self, reason: str) -> None:
        log.warning("shm connection closed: %s", reason,
                    extra={"event": "dataplane.shm_error", "peer": self._peer, "reason": reason})
        self.abort()

    def _on_bells_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._closing = True
        self._queue.clear()
        self._queued = 0
        try:
            self._protocol.connection_lost(exc)
        finally:
            self._unmap()

    def _unmap(self) -> None:
        for view in (self._tx, self._rx):
            with contextlib.suppress(BufferError):
                view.release()
        for m in (self._tx_map, self._rx_map):
            if m is not None:
                with contextlib.suppress(BufferError):
                    m.close()


class ShmRefusedError(UnavailableError):
    """The other end of an shm handshake refused it (credentials, seals):
    over TCP the same peer may still be reachable."""


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (``SO_PEERCRED``)."""
    _pid, uid, _gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return int(uid)


def _uid_allowed(uid: int) -> bool:
    """Rings are shared only between processes of one user (or root)."""
    return uid in (os.geteuid(), 0)


def check_ring(fd: int, size: int) -> None:
    """ValueError unless ``fd`` is a memfd of ``size`` bytes sealed against
    shrinking and growing."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:  # EINVAL: not a memfd / shmem file
        raise ValueError(f"shm ring is not a sealable memfd ({exc.strerror})") from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise ValueError(f"shm ring is not sealed against resizing (seals {seals:#x}, "
                         f"need F_SEAL_SHRINK|F_SEAL_GROW)")
    if os.fstat(fd).st_size != size:
        raise ValueError("shm ring has the wrong size")


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def _reply(conn: socket.socket, ok: bool, reason: str = "") -> None:
    """The server's answer to a hello (one small write on a fresh socket)."""
    text = reason.encode()[:_MAX_REASON]
    with contextlib.suppress(OSError):
        conn.send(_REPLY.pack(_REPLY_MAGIC, 1 if ok else 0, len(text)) + text)


async def _attach(sock: socket.socket, tx: mmap.mmap, rx: mmap.mmap, protocol: FrameProtocol,
                  peer: str) -> ShmStreamTransport:
    loop = asyncio.get_running_loop()
    transport = ShmStreamTransport(tx, rx, protocol, peer)
    # The protocol must be ready before the first doorbell can arrive.
    protocol.connection_made(transport)
    try:
        await loop.create_unix_connection(lambda: _Bells(transport), sock=sock)
    except BaseException as exc:
        sock.close()
        transport._on_bells_lost(exc if isinstance(exc, Exception) else None)
        raise
    return transport


async def _read_reply(sock: socket.socket, port: int) -> None:
    """Read exactly the server's answer (doorbells may follow it at once)."""
    loop = asyncio.get_running_loop()

    async def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = await loop.sock_recv(sock, n - len(buf))
            if not chunk:
                raise ShmRefusedError(f"shm server on port {port} hung up during the handshake")
            buf += chunk
        return buf

    magic, ok, n = _REPLY.unpack(await exactly(_REPLY.size))
    if magic != _REPLY_MAGIC or n > _MAX_REASON:
        raise UnavailableError(f"shm server on port {port} answered the handshake with {magic!r}")
    reason = (await exactly(n)).decode(errors="replace") if n else ""
    if not ok:
        raise ShmRefusedError(f"shm server on port {port} refused the handshake: {reason}")


class ShmListener(Listener):
    def __init__(self, socks: list[tuple[socket.socket, str]], factory: ProtocolFactory, limits: Limits) -> None:
        self.socks = [s for s, _ in socks]
        self.address = socks[0][1][1:]
        self.factory = factory
        self.limits = limits
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._accept_loop(s)) for s in self.socks]
        self._handshakes: set[asyncio.Task[None]] = set()

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(sock)
            task = loop.create_task(self._handshake(conn))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _handshake(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        fds: list[int] = []
        try:
            conn.setblocking(False)
            uid = peer_uid(conn)
            if not _uid_allowed(uid):
                # before reading anything: a stranger's descriptors are never taken
                log.warning("shm connection from uid %d refused (this daemon runs as uid %d)", uid,
                            os.geteuid(), extra={"event": "dataplane.shm_refused", "uid": uid})
                _reply(conn, False, f"uid {uid} may not use this daemon's shm transport (same uid or root only)")
                conn.close()
                return
            async with asyncio.timeout(10):
                while True:
                    try:
                        msg, fds, _, _ = socket.recv_fds(conn, _HELLO.size, 2)
                        break
                    except BlockingIOError:
                        ready = loop.create_future()
                        loop.add_reader(conn.fileno(), ready.set_result, None)
                        try:
                            await ready
                        finally:
                            loop.remove_reader(conn.fileno())
            if len(msg) != _HELLO.size or len(fds) != 2:
                raise ValueError("bad shm hello")
            magic, size = _HELLO.unpack(msg)
            if magic != _HELLO_MAGIC or not _MIN_RING <= size <= _MAX_RING:
                raise ValueError(f"bad shm hello {magic!r} size {size}")
            for fd in fds:
                check_ring(fd, size)
            # client->server is our rx, server->client our tx.
            rx, tx = _map(fds[0], size), _map(fds[1], size)
        except Exception as exc:
            log.warning("shm handshake failed: %s", exc,
                        extra={"event": "dataplane.shm_handshake_failed", "reason": str(exc)})
            _reply(conn, False, str(exc) or type(exc).__name__)
            conn.close()
            return
        finally:
            for fd in fds:
                os.close(fd)
        _reply(conn, True)
        await _attach(conn, tx, rx, self.factory(), "shm-client")

    async def close(self) -> None:
        for t in [*self._tasks, *self._handshakes]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._handshakes, return_exceptions=True)
        for s in self.socks:
            s.close()


class ShmTransport(Transport):
    name = "shm"

    @classmethod
    def available(cls) -> bool:
        return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")

    async def connect(
        self, host: str, port: int, factory: ProtocolFactory, *, limits: Limits, timeout: float
    ) -> FrameProtocol:
        loop = asyncio.get_running_loop()
        size = limits.shm_ring_bytes
        # The server of this address first, then the port's (a server on a
        # wildcard address, or of a release that had only the port's name).
        names = list(dict.fromkeys([socket_name(port, host), socket_name(port)]))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        fds: list[int] = []
        maps: list[mmap.mmap] = []
        try:
            sock.setblocking(False)
            async with asyncio.timeout(timeout):
                for i, name in enumerate(names):
                    try:
                        await loop.sock_connect(sock, name)
                        break
                    except (ConnectionRefusedError, FileNotFoundError):
                        if i == len(names) - 1:
                            raise
                        sock.close()  # no server of that name: try the next on a fresh socket
                        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        sock.setblocking(False)
                uid = peer_uid(sock)
                if not _uid_allowed(uid):
                    raise ShmRefusedError(f"not handing shm rings to {name[1:]!r}: it is "
                                          f"held by uid {uid}, not by this user or root")
                for _ in range(2):
                    fd = os.memfd_create("tierfs-dp-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                    fds.append(fd)
                    os.ftruncate(fd, size)
                    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
                socket.send_fds(sock, [_HELLO.pack(_HELLO_MAGIC, size)], fds)
                maps = [_map(fds[0], size), _map(fds[1], size)]
                await _read_reply(sock, port)
            tx, rx = maps
        except BaseException as exc:
            # Cancelled too (a pool closing while it connects): the socket and
            # the rings must not outlive the attempt (an unclosed socket, and a
            # server that keeps a half-made connection).
            sock.close()
            for m in maps:
                m.close()
            if isinstance(exc, UnavailableError) or not isinstance(exc, (OSError, TimeoutError)):
                raise
            raise UnavailableError(
                f"cannot connect to {host}:{port} over shm: {exc or 'timeout'}") from None
        finally:
            for fd in fds:
                os.close(fd)
        protocol = factory()
        await _attach(sock, tx, rx, protocol, f"shm:{port}")
        return protocol

    async def listen(self, host: str, port: int, factory: ProtocolFactory, *, limits: Limits) -> Listener:
        if not port:
            raise UnavailableError("the shm transport needs the server's TCP port")
        # The port's name (what a client dialling any address of this host
        # finds) and, on a specific address, that address's own: a second
        # daemon on another address with the same port finds the port's name
        # taken and is still reached by the clients that dial its address.
        bound: list[tuple[socket.socket, str]] = []
        errors: list[tuple[str, OSError]] = []
        try:
            for name in dict.fromkeys([socket_name(port, host), socket_name(port)]):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.bind(name)
                    sock.listen(256)
                    sock.setblocking(False)
                except OSError as bind_error:
                    sock.close()
                    errors.append((name, bind_error))
                    continue
                bound.append((sock, name))
        except BaseException:
            for s, _ in bound:
                s.close()
            raise
        if not bound:
            raise errors[0][1]
        for name, why in errors:
            log.info("shm: %r is taken (%s; another daemon with port %d on this host?): serving shm as %s",
                     name[1:], why, port, ", ".join(repr(n[1:]) for _, n in bound))
        return ShmListener(bound, factory, limits)
