"""The data-plane client: a pool of connections per peer, many requests in
flight on each, answers matched by request id and accepted in any order.

A READ answer's payload is received straight into the caller's buffer. A
request that times out or is cancelled before its answer starts arriving is
forgotten (its answer is drained into scratch space); one whose payload is
already landing in the caller's buffer aborts the connection, because the
caller is about to reuse that buffer. Errors: the server's TierFSError is
re-raised as the same class; anything wrong with the connection becomes
UnavailableError, a missed deadline TimeoutError_.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from tierfs.capability import KIND_FILE, KIND_KV, KIND_NODE, OP_READ, OP_WRITE, Capability, decode
from tierfs.errors import (
    CapabilityExpiredError,
    InvalidArgumentError,
    ProtocolError,
    TierFSError,
    TimeoutError_,
    UnauthenticatedError,
    UnavailableError,
    error_from_code,
)
from tierfs.net.framing import FrameProtocol, log
from tierfs.net.protocol import (
    ALL,
    F_MORE,
    F_RESPONSE,
    HEADER_SIZE,
    KV_GROUP,
    KV_OPS,
    KV_PRESENT,
    KV_SIZE_ONLY,
    KV_STAMP_SHIFT,
    KV_WITH_CRC,
    MAX_CAP_SLOTS,
    Header,
    Limits,
    Op,
    crc32c,
    encode_header,
    serial_of,
)
from tierfs.net.shm import ShmRefusedError
from tierfs.net.transport import Transport, get_transport
from tierfs.storage.api import FragmentInfo, FragmentKey

__all__ = ["Address", "CapabilityCache", "DataClient", "KVGetItem", "KVPutItem", "ReadItem", "WriteItem", "parse_address"]

Address = str | tuple[str, int]
#: (target, key, dest, offset)
ReadItem = tuple[int, FragmentKey, memoryview, int]
#: (target, key, data)
WriteItem = tuple[int, FragmentKey, Any]

_MAX_ERROR_PAYLOAD = 1 << 16
_ANSWER_PAYLOAD_OPS = frozenset({int(Op.READ), int(Op.KV_GET), int(Op.KV_EXISTS)})
_SENDS_PAYLOAD = frozenset({int(Op.WRITE), int(Op.KV_PUT)})
_UNSET: Any = object()
_LOOPBACK = ("127.", "localhost", "::1")
_READ_OPS = frozenset({int(Op.READ), int(Op.STAT), int(Op.KV_GET), int(Op.KV_EXISTS)})
#: Entries a CapabilityCache keeps before it drops expired ones (then the oldest).
_CAP_CACHE_SOFT_LIMIT = 4096


class CapabilityCache:
    """The capabilities a data client holds (from meta's replies), by what
    they cover: (kind, inode or pool, ops). A request picks the one for its
    inode/pool and direction; fragment requests fall back to a node
    capability (storage daemons' repair traffic)."""

    def __init__(self) -> None:
        self._by: dict[tuple[int, int, int], tuple[bytes, Capability]] = {}
        self.node: bytes | None = None

    def __bool__(self) -> bool:
        return bool(self._by) or self.node is not None

    def __len__(self) -> int:
        return len(self._by) + (self.node is not None)

    def add(self, raw: bytes) -> None:
        """Keep ``raw`` (an encoded capability) unless one covering the same
        thing lives longer already."""
        c = decode(raw)
        if c.kind == KIND_NODE:
            self.node = bytes(raw)
            return
        k = (c.kind, c.scope, c.ops)
        old = self._by.get(k)
        if old is not None and old[1].expiry_ms > c.expiry_ms:
            return
        self._by.pop(k, None)
        self._by[k] = (bytes(raw), c)
        if len(self._by) > _CAP_CACHE_SOFT_LIMIT:
            self._prune(c.expiry_ms - 600_000)

    def _prune(self, before_ms: int) -> None:
        for k in [k for k, (_, c) in self._by.items() if c.expiry_ms < before_ms]:
            del self._by[k]
        while len(self._by) > _CAP_CACHE_SOFT_LIMIT:
            del self._by[next(iter(self._by))]

    def lookup(self, op: int, scope: int) -> bytes | None:
        """The capability for an ``op`` request on inode/pool ``scope``."""
        need = OP_READ if op in _READ_OPS else OP_WRITE
        kind = KIND_KV if op in KV_OPS else KIND_FILE
        by = self._by
        e = by.get((kind, scope, need)) or by.get((kind, scope, OP_READ | OP_WRITE))
        if e is not None:
            return e[0]
        return self.node if kind == KIND_FILE else None

    def forget(self, kind: int, scope: int) -> None:
        for k in [k for k in self._by if k[0] == kind and k[1] == scope]:
            del self._by[k]


#: What a DataClient calls for a fresh capability: (kind, inode or pool, op).
CapRefresher = Callable[[int, int, int], Awaitable[None]]


def parse_address(addr: Address) -> tuple[str, int]:
    if isinstance(addr, tuple):
        return addr[0], int(addr[1])
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise InvalidArgumentError(f"bad data-plane address {addr!r} (want host:port)")
    return host.strip("[]"), int(port)


#: Why a connection this client aborted itself for a request it gave up on.
_ABANDONED = "a request was abandoned mid-transfer"


class _Abandoned(UnavailableError):
    """A request failed because its connection was dropped for another one
    (not for anything of its own): :meth:`DataClient._call` sends it again."""


class _Expired(Exception):
    """Internal: a request's timer fired before its answer came."""


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


class _Req:
    __slots__ = ("cap", "crc", "dest", "key", "length", "offset", "op", "payload", "payload2", "target")

    def __init__(self, op: Op, target: int, key: FragmentKey | tuple[int, int, int, int], *, offset: int = 0,
                 length: int = 0, payload: memoryview | None = None, dest: memoryview | None = None,
                 payload2: memoryview | bytes | None = None, crc: int | None = None) -> None:
        self.op, self.target, self.key = op, target, key
        self.offset, self.length, self.payload, self.dest = offset, length, payload, dest
        # A payload in two pieces (a KV put: value, then key) and its CRC32C
        # when the caller has it already.
        self.payload2, self.crc = payload2, crc
        self.cap: bytes | None = None


#: (target, pool id, key, value, value CRC32C or None, put flags, TTL ms)
KVPutItem = tuple[int, int, bytes, memoryview, int | None, int, int]
#: (target, pool id, key, dest), then optionally the placement stamp the
#: reader's map requires (0: none; tierfs.net.protocol.KV_STAMP_SHIFT)
KVGetItem = tuple[int, int, bytes, memoryview] | tuple[int, int, bytes, memoryview, int]


def _kv_put_req(item: KVPutItem, pin_ttl_ms: int = 0) -> _Req:
    target, pool, key, value, vcrc, flags, ttl_ms = item
    if vcrc is None:
        vcrc = crc32c(value)
    return _Req(Op.KV_PUT, target, (pool, ttl_ms, flags, vcrc), offset=len(key), length=pin_ttl_ms,
                payload=value, payload2=key, crc=crc32c(key, vcrc))


class _Pending:
    __slots__ = ("abandoned", "dest", "fut", "op")

    def __init__(self, fut: asyncio.Future[tuple[Header, memoryview | None]], op: int,
                 dest: memoryview | None) -> None:
        self.fut = fut
        self.op = op
        self.dest = dest
        self.abandoned = False


class _ClientConnection(FrameProtocol):
    role = "client"

    def __init__(self, limits: Limits) -> None:
        super().__init__(limits)
        self.offload_min = limits.offload_min_bytes
        self.pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._lost: asyncio.Future[None] | None = None
        self.reason = "connection closed"
        # The capabilities this connection's peer holds, by slot (CAP frames).
        self.slots: dict[bytes, int] = {}
        self._slot_seq = 0

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._lost = asyncio.get_running_loop().create_future()

    def _on_violation(self, reason: str) -> None:
        self.reason = f"protocol violation from server: {reason}"

    def _on_lost(self, exc: Exception | None) -> None:
        reason = f"{self.reason}: {exc}" if exc else self.reason
        cls = _Abandoned if self.reason == _ABANDONED else UnavailableError
        for p in self.pending.values():
            if not p.fut.done():
                p.fut.set_exception(cls(f"data-plane connection to {self.peer} lost ({reason})"))
        self.pending.clear()
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)

    def _on_header(self, hdr: Header) -> memoryview | None:
        if not hdr.flags & F_RESPONSE:
            raise ProtocolError(f"request frame (op {hdr.op}) sent to the client")
        p = self.pending.get(hdr.request_id)
        if p is None or p.op != hdr.op:
            raise ProtocolError(f"answer to unknown request {hdr.request_id} (op {hdr.op})")
        if hdr.status:
            if hdr.payload_len > _MAX_ERROR_PAYLOAD:
                raise ProtocolError(f"error message of {hdr.payload_len} bytes")
            return memoryview(bytearray(hdr.payload_len))
        if hdr.op not in _ANSWER_PAYLOAD_OPS:
            raise ProtocolError(f"op {Op(hdr.op).name} answer carries {hdr.payload_len} bytes")
        if p.abandoned:
            return None
        if p.dest is None:
            return memoryview(bytearray(hdr.payload_len))
        if hdr.payload_len > len(p.dest):
            raise ProtocolError(f"read answer of {hdr.payload_len} bytes for a {len(p.dest)}-byte buffer")
        return p.dest[: hdr.payload_len]

    def _forget(self, hdr: Header) -> bool:
        p = self.pending.get(hdr.request_id)
        if p is not None and p.abandoned:
            del self.pending[hdr.request_id]
            return True
        return False

    def _on_frame(self, hdr: Header, payload: memoryview | None) -> None:
        if not hdr.flags & F_RESPONSE:
            raise ProtocolError(f"request frame (op {hdr.op}) sent to the client")
        p = self.pending.pop(hdr.request_id, None)
        if p is None or p.op != hdr.op:
            raise ProtocolError(f"answer to unknown request {hdr.request_id} (op {hdr.op})")
        if not p.abandoned and not p.fut.done():
            p.fut.set_result((hdr, payload))

    def _cap_frame(self, cap: bytes, out: list[Any]) -> int:
        """The slot of ``cap`` on this connection; a CAP frame for it goes
        into ``out`` first if the peer does not hold it yet. Its answer is
        not waited for: the server checks frames in order, and a refusal
        answers the requests that name the slot too."""
        slot = self.slots.get(cap)
        if slot is not None:
            return slot
        if self._slot_seq >= MAX_CAP_SLOTS:
            # Start over: a CAP for a slot in use replaces it, and requests
            # already sent were checked under the old one.
            self.slots.clear()
            self._slot_seq = 0
        self._slot_seq += 1
        slot = self._slot_seq
        rid = next(self._ids)
        fut: asyncio.Future[tuple[Header, memoryview | None]] = asyncio.get_running_loop().create_future()
        self.pending[rid] = _Pending(fut, Op.CAP, None)
        head = bytearray(HEADER_SIZE)
        encode_header(head, Op.CAP, rid, status=slot, payload_len=len(cap), payload_crc=crc32c(cap))
        self.slots[cap] = slot

        def answered(f: asyncio.Future[tuple[Header, memoryview | None]]) -> None:
            refused = f.cancelled() or f.exception() is not None or f.result()[0].status != 0
            if refused and self.slots.get(cap) == slot:
                del self.slots[cap]  # sent again with the next request that needs it

        fut.add_done_callback(answered)
        out.append(head)
        out.append(cap)
        return slot

    async def call(self, op: Op, target: int, key: FragmentKey | tuple[int, int, int, int] | None, *,
                   timeout: float, offset: int = 0, length: int = 0, payload: memoryview | None = None,
                   dest: memoryview | None = None, more: bool = False, payload2: memoryview | bytes | None = None,
                   crc: int | None = None, cap: bytes | None = None) -> tuple[Header, memoryview | None]:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise UnavailableError(f"data-plane connection to {self.peer} is closed ({self.reason})")
        pre: list[Any] = []
        slot = 0 if cap is None else self._cap_frame(cap, pre)
        rid = next(self._ids)
        fut: asyncio.Future[tuple[Header, memoryview | None]] = asyncio.get_running_loop().create_future()
        p = _Pending(fut, op, dest)
        head = bytearray(HEADER_SIZE)
        n = 0 if payload is None else len(payload)
        n2 = 0 if payload2 is None else len(payload2)
        if crc is None:
            crc = crc32c(payload) if payload is not None and n else 0
        encode_header(head, op, rid, flags=F_MORE if more else 0, target=target, key=key, status=slot,
                      offset=offset, length=length, payload_len=n + n2, payload_crc=crc)
        self.pending[rid] = p
        if pre:
            self.transport.writelines([*pre, head, *(b for b in (payload, payload2) if b is not None and len(b))])
        elif n2:
            self.transport.writelines([head, payload, payload2] if n else [head, payload2])
        elif n:
            self.transport.writelines([head, payload])
        else:
            self.transport.write(head)
        # A bare timer handle: cheaper per request than asyncio.timeout().
        timer = asyncio.get_running_loop().call_later(timeout, _expire, fut)
        try:
            hdr, body = await fut
        except _Expired:
            self._abandon(rid, p)
            raise TimeoutError_(f"data-plane {op.name} to {self.peer} timed out after {timeout:g}s") from None
        except asyncio.CancelledError:
            self._abandon(rid, p)
            raise
        finally:
            timer.cancel()
        if hdr.status:
            raise error_from_code(hdr.status, bytes(body or b"").decode("utf-8", "replace"))
        return hdr, body

    async def call_many(self, reqs: Sequence[_Req], timeout: float) -> list[Header | TierFSError]:
        """Send ``reqs`` with one ``writelines`` (MORE on all but the last)
        and wait for every answer; each slot holds its Header or its error."""
        if self.closed or self.transport is None or self.transport.is_closing():
            raise UnavailableError(f"data-plane connection to {self.peer} is closed ({self.reason})")
        loop = asyncio.get_running_loop()
        n = len(reqs)
        heads = memoryview(bytearray(HEADER_SIZE * n))
        out: list[memoryview] = []
        sent: list[tuple[int, _Pending]] = []
        for i, r in enumerate(reqs):
            slot = 0 if r.cap is None else self._cap_frame(r.cap, out)
            rid = next(self._ids)
            head = heads[i * HEADER_SIZE:(i + 1) * HEADER_SIZE]
            size = 0 if r.payload is None else len(r.payload)
            size2 = 0 if r.payload2 is None else len(r.payload2)
            crc = r.crc
            if crc is None:
                crc = crc32c(r.payload) if r.payload is not None and size else 0
            encode_header(head, r.op, rid, flags=F_MORE if i < n - 1 else 0, target=r.target,
                          key=r.key, status=slot, offset=r.offset, length=r.length, payload_len=size + size2,
                          payload_crc=crc)
            p = _Pending(loop.create_future(), r.op, r.dest)
            self.pending[rid] = p
            sent.append((rid, p))
            out.append(head)
            if r.payload is not None and size:
                out.append(r.payload)
            if r.payload2 is not None and size2:
                out.append(r.payload2)  # type: ignore[arg-type]
        self.transport.writelines(out)
        futs = [p.fut for _, p in sent]
        try:
            await asyncio.wait(futs, timeout=timeout)
        except asyncio.CancelledError:
            for rid, p in sent:
                if not p.fut.done():
                    self._abandon(rid, p)
                    p.fut.cancel()  # else a later connection loss sets an exception nobody retrieves
                elif not p.fut.cancelled():
                    # Failed as this caller was cancelled (the connection
                    # lost in the same turn of the loop): retrieved here, or
                    # asyncio reports "Future exception was never retrieved".
                    p.fut.exception()
            raise
        results: list[Header | TierFSError] = []
        for rid, p in sent:
            if not p.fut.done():
                self._abandon(rid, p)
                p.fut.cancel()
                results.append(TimeoutError_(
                    f"data-plane {Op(p.op).name} to {self.peer} timed out after {timeout:g}s"))
                continue
            exc = p.fut.exception()
            if exc is not None:
                results.append(exc if isinstance(exc, TierFSError) else UnavailableError(str(exc)))
                continue
            hdr, body = p.fut.result()
            if hdr.status:
                results.append(error_from_code(hdr.status, bytes(body or b"").decode("utf-8", "replace")))
            else:
                results.append(hdr)
        return results

    def _abandon(self, rid: int, p: _Pending) -> None:
        # Copies of its answer running on workers (framing, "Off the loop")
        # finish before the caller hears of the failure, even on a
        # connection already closing.
        self.settle_copies(rid)
        if self.closed:
            return
        p.abandoned = True
        cur = self.receiving
        payload_busy = cur is not None and cur.request_id == rid and self._payload is not None
        # A write payload the transport still references, or a read answer
        # landing in the caller's buffer, must not outlive this call.
        if payload_busy or (p.op in _SENDS_PAYLOAD and self.transport.get_write_buffer_size()):
            self.reason = _ABANDONED
            self.abort()

    def begin_close(self) -> asyncio.Future[None] | None:
        """Close the transport now; the future is done once it is gone."""
        if self.transport is not None and not self.closed:
            self.transport.close()
        return self._lost

    async def close(self) -> None:
        lost = self.begin_close()
        if lost is not None:
            await lost


class _PeerPool:
    def __init__(self, client: DataClient, host: str, port: int) -> None:
        self.client = client
        self.host = host
        self.port = port
        self.conns: list[_ClientConnection] = []
        self.connecting: set[asyncio.Task[_ClientConnection]] = set()
        self.transport = client._transport_for(host)
        #: set by close(): no connection is opened (or kept) after it, so
        #: none can outlive the pool unclosed (a ResourceWarning at GC)
        self.closed = False

    def ready(self) -> _ClientConnection | None:
        """A connection to use right now without opening one, if that is
        what :meth:`get` would pick."""
        best: _ClientConnection | None = None
        live = 0
        for c in self.conns:
            if not c.closed:
                live += 1
                if best is None or len(c.pending) < len(best.pending):
                    best = c
        if best is None:
            return None
        if not best.pending or live + len(self.connecting) >= self.client.connections_per_peer:
            return best
        return None

    async def get(self) -> _ClientConnection:
        """The least busy live connection; a new one while the pool is below
        its size and every connection has work."""
        limit = self.client.connections_per_peer
        while True:
            if self.closed:
                raise UnavailableError(f"data-plane client for {self.host}:{self.port} is closed")
            live = [c for c in self.conns if not c.closed]
            if len(live) != len(self.conns):
                self.conns = live
            best = min(live, key=lambda c: len(c.pending), default=None)
            room = len(live) + len(self.connecting) < limit
            if best is not None and (not best.pending or not room):
                return best
            if room:
                task = asyncio.get_running_loop().create_task(self._connect())
                self.connecting.add(task)
                task.add_done_callback(self._connected)
                return await asyncio.shield(task)
            # Full of connections still being opened: wait for one of them.
            done, _ = await asyncio.wait(set(self.connecting), return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]

    async def _connect(self) -> _ClientConnection:
        try:
            conn = await self.transport.connect(
                self.host, self.port, lambda: _ClientConnection(self.client.limits),
                limits=self.client.limits, timeout=self.client.connect_timeout)
        except ShmRefusedError as exc:
            if self.client.transport_name != "auto":
                raise
            # "auto" picked shm only because the peer is local; a daemon of
            # another user refuses it (docs/dataplane.md): use TCP from now on.
            log.info("%s:%d: %s; using tcp", self.host, self.port, exc)
            self.transport = self.client._transport_named("tcp")
            return await self._connect()
        assert isinstance(conn, _ClientConnection)
        return conn

    def _connected(self, task: asyncio.Task[_ClientConnection]) -> None:
        self.connecting.discard(task)
        if task.cancelled() or task.exception() is not None:
            return
        conn = task.result()
        if self.closed:
            # Opened while the pool closed (the connect raced the cancel):
            # nobody will close it later, so close it now.
            if conn.transport is not None and not conn.closed:
                conn.transport.close()
            return
        self.conns.append(conn)

    def begin_close(self) -> list[asyncio.Future[Any]]:
        """Close every connection and cancel every connect now, without
        waiting (a close that is itself cancelled must not leave a socket
        open); returns what to wait for until they are gone."""
        self.closed = True
        waits: list[asyncio.Future[Any]] = list(self.connecting)
        for t in self.connecting:
            t.cancel()  # one that completes anyway is closed by _connected
        conns, self.conns = self.conns, []
        for c in conns:
            lost = c.begin_close()
            if lost is not None:
                waits.append(lost)
        return waits

    async def close(self) -> None:
        await asyncio.gather(*self.begin_close(), return_exceptions=True)


class DataClient:
    """Talks to data-plane servers. Targets are routed to server addresses
    with :meth:`set_route` (or ``routes=``); every method takes a target id."""

    def __init__(
        self,
        *,
        transport: str = "tcp",
        connections_per_peer: int = 2,
        request_timeout: float = 30.0,
        connect_timeout: float = 5.0,
        limits: Limits | None = None,
        routes: Mapping[int, Address] | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if connections_per_peer < 1:
            raise InvalidArgumentError("connections_per_peer must be at least 1")
        self.transport_name = transport
        self.connections_per_peer = connections_per_peer
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.limits = limits or Limits()
        self.routes: dict[int, tuple[str, int]] = {}
        #: Capabilities sent with each request (docs/security-caps.md).
        self.caps = CapabilityCache()
        #: Fetches a fresh capability (into ``caps``) when a server answers
        #: CapabilityExpiredError, or refuses a request sent without one;
        #: the request is retried once after it.
        self.cap_refresher: CapRefresher | None = None
        self._pools: dict[tuple[str, int], _PeerPool] = {}
        self._closed = False
        self._transports: dict[str, Transport] = {}
        #: TLS of tcp connections (tierfs.tls; None: plaintext).
        self.tls = tls
        if transport != "auto":
            self._transports[transport] = get_transport(transport, tls=tls)
        for target, addr in (routes or {}).items():
            self.set_route(target, addr)

    def _transport_for(self, host: str) -> Transport:
        name = self.transport_name
        if name == "auto":
            name = "shm" if host.startswith(_LOOPBACK) and get_transport("shm").available() else "tcp"
        return self._transport_named(name)

    def _transport_named(self, name: str) -> Transport:
        t = self._transports.get(name)
        if t is None:
            t = self._transports[name] = get_transport(name, tls=self.tls)
        return t

    def set_route(self, target: int, address: Address) -> None:
        self.routes[target] = parse_address(address)

    def _pool(self, target: int) -> _PeerPool:
        addr = self.routes.get(target)
        if addr is None:
            raise UnavailableError(f"no data-plane address known for target {target}")
        pool = self._pools.get(addr)
        if pool is None:
            if self._closed:
                # A request still running when close() began must not open
                # a pool that nobody would close.
                raise UnavailableError("the data-plane client is closed")
            pool = self._pools[addr] = _PeerPool(self, *addr)
        return pool

    def _cap_for(self, op: int, key: FragmentKey | tuple[int, int, int, int] | None) -> bytes | None:
        if not self.caps or key is None or op == Op.PING:
            return None
        return self.caps.lookup(op, key[0] if isinstance(key, tuple) else key.inode)

    def _retry_cap(self, exc: TierFSError, cap: bytes | None) -> bool:
        return self.cap_refresher is not None and (
            isinstance(exc, CapabilityExpiredError) or (cap is None and isinstance(exc, UnauthenticatedError)))

    async def _refresh_cap(self, op: int, key: FragmentKey | tuple[int, int, int, int] | None) -> None:
        assert self.cap_refresher is not None and key is not None
        scope = key[0] if isinstance(key, tuple) else key.inode
        kind = KIND_KV if op in KV_OPS else KIND_FILE
        await self.cap_refresher(kind, scope, OP_READ if op in _READ_OPS else OP_WRITE)

    async def _call(self, target: int, op: Op, key: FragmentKey | tuple[int, int, int, int] | None,
                    timeout: float | None = None,
                    **kw: Any) -> tuple[Header, memoryview | None]:
        cap = self._cap_for(op, key)
        try:
            try:
                return await self._call1(target, op, key, timeout, cap=cap, **kw)
            except _Abandoned:
                # This client dropped its connection for another request it
                # gave up on mid-transfer: this one did nothing wrong and
                # goes again, once, on a new connection (a KV delete failed
                # as "did not reach target" on a healthy cluster, stop 47).
                return await self._call1(target, op, key, timeout, cap=cap, **kw)
        except (CapabilityExpiredError, UnauthenticatedError) as exc:
            if not self._retry_cap(exc, cap):
                raise
        await self._refresh_cap(op, key)
        return await self._call1(target, op, key, timeout, cap=self._cap_for(op, key), **kw)

    async def _call1(self, target: int, op: Op, key: FragmentKey | tuple[int, int, int, int] | None,
                     timeout: float | None = None,
                     **kw: Any) -> tuple[Header, memoryview | None]:
        t = self.request_timeout if timeout is None else timeout
        pool = self._pool(target)
        conn = pool.ready()
        if conn is not None:
            return await conn.call(op, target, key, timeout=t, **kw)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + t
        try:
            async with asyncio.timeout_at(deadline):
                conn = await pool.get()
        except TimeoutError:
            raise TimeoutError_(f"connecting for {op.name} on target {target} timed out") from None
        # One deadline covers getting a connection and the request itself.
        return await conn.call(op, target, key, timeout=max(0.0, deadline - loop.time()), **kw)

    # --- operations ------------------------------------------------------------

    async def ping(self, target: int, *, timeout: float | None = None) -> None:
        await self._call(target, Op.PING, None, timeout)

    async def write(self, target: int, key: FragmentKey, data: Any, *, timeout: float | None = None) -> None:
        """Store ``data`` (any buffer) as fragment ``key`` on ``target``."""
        view = memoryview(data).cast("B")
        if len(view) > self.limits.max_frame_bytes:
            raise InvalidArgumentError(
                f"fragment of {len(view)} bytes exceeds the frame limit {self.limits.max_frame_bytes}")
        await self._call(target, Op.WRITE, key, timeout, payload=view)

    async def read_into(self, target: int, key: FragmentKey, dest: Any, offset: int = 0, *,
                        timeout: float | None = None, crcs: list[int] | None = None,
                        serials: list[int] | None = None) -> int:
        """Read ``len(dest)`` bytes of ``key`` from ``offset`` straight into
        ``dest``; returns how many arrived (fewer at the fragment's end).
        With ``crcs`` (a list), it gets the CRC32C of the bytes read, which
        the framing layer checked on arrival; with ``serials``, the serial
        of the fragment file they came from (0: the daemon did not say)."""
        view = memoryview(dest).cast("B")
        if view.readonly:
            raise InvalidArgumentError("read_into needs a writable buffer")
        if len(view) > self.limits.max_frame_bytes:
            raise InvalidArgumentError(
                f"read of {len(view)} bytes exceeds the frame limit {self.limits.max_frame_bytes}")
        if offset < 0:
            raise InvalidArgumentError(f"negative offset {offset}")
        hdr, _ = await self._call(target, Op.READ, key, timeout, offset=offset, length=len(view), dest=view)
        if crcs is not None:
            crcs[:] = [hdr.payload_crc]
        if serials is not None:
            serials[:] = [serial_of(hdr.length)]
        return hdr.payload_len

    async def read(self, target: int, key: FragmentKey, offset: int = 0, length: int = -1, *,
                   timeout: float | None = None) -> bytes:
        """The bytes of ``key`` in [offset, offset+length) (-1: to the end)."""
        if offset < 0:
            raise InvalidArgumentError(f"negative offset {offset}")
        _, body = await self._call(target, Op.READ, key, timeout, offset=offset,
                                   length=ALL if length < 0 else length)
        return bytes(body) if body is not None else b""

    async def delete(self, target: int, key: FragmentKey, *, timeout: float | None = None) -> bool:
        hdr, _ = await self._call(target, Op.DELETE, key, timeout)
        return bool(hdr.length)

    async def stat(self, target: int, key: FragmentKey, *, timeout: float | None = None) -> FragmentInfo:
        hdr, _ = await self._call(target, Op.STAT, key, timeout)
        return FragmentInfo(key, hdr.length, hdr.payload_crc, serial_of(hdr.offset))

    async def stat_batch(self, items: Sequence[tuple[int, FragmentKey]], *,
                         timeout: float | None = None) -> list[FragmentInfo | TierFSError]:
        """Many ``stat`` at once (size and stored CRC32C of each fragment),
        sent like :meth:`read_batch`; results in item order, the error in
        its own slot."""
        res = await self._batch([_Req(Op.STAT, t, k) for t, k in items], timeout)
        return [FragmentInfo(k, r.length, r.payload_crc, serial_of(r.offset)) if isinstance(r, Header) else r
                for (_, k), r in zip(items, res, strict=True)]

    async def read_batch(self, items: Iterable[ReadItem], *, timeout: float | None = None,
                         crcs: list[int] | None = None, serials: list[int] | None = None) -> list[int | TierFSError]:
        """Many ``read_into`` at once. The requests for one server go out as
        back-to-back frames in a single ``writelines`` (MORE flag on all but
        the last); answers land in their buffers in any order. Results come
        back in item order: bytes read, or the error in its own slot. With
        ``crcs`` (a list), it gets the CRC32C of each item's bytes read (0
        for an error), which the framing layer checked on arrival: callers
        need no pass of their own; with ``serials``, each item's fragment-file
        serial (0: an error, or the daemon did not say)."""
        reqs: list[_Req | TierFSError] = []
        for target, key, dest, offset in items:
            view = memoryview(dest).cast("B")
            if view.readonly or offset < 0 or len(view) > self.limits.max_frame_bytes:
                reqs.append(InvalidArgumentError(
                    f"bad read_batch item for {key}: writable buffer of at most "
                    f"{self.limits.max_frame_bytes} bytes and offset >= 0 needed"))
                continue
            reqs.append(_Req(Op.READ, target, key, offset=offset, length=len(view), dest=view))
        res = await self._batch(reqs, timeout)
        if crcs is not None:
            crcs[:] = [r.payload_crc if isinstance(r, Header) else 0 for r in res]
        if serials is not None:
            serials[:] = [serial_of(r.length) if isinstance(r, Header) else 0 for r in res]
        return [r.payload_len if isinstance(r, Header) else r for r in res]

    async def write_batch(self, items: Iterable[WriteItem], *, timeout: float | None = None) -> list[TierFSError | None]:
        """Many ``write`` at once, sent like :meth:`read_batch`; results in
        item order, None for success."""
        reqs: list[_Req | TierFSError] = []
        for target, key, data in items:
            view = memoryview(data).cast("B")
            if len(view) > self.limits.max_frame_bytes:
                reqs.append(InvalidArgumentError(
                    f"fragment of {len(view)} bytes exceeds the frame limit {self.limits.max_frame_bytes}"))
                continue
            reqs.append(_Req(Op.WRITE, target, key, payload=view))
        res = await self._batch(reqs, timeout)
        return [None if isinstance(r, Header) else r for r in res]

    async def _batch(self, reqs: list[_Req | TierFSError], timeout: float | None) -> list[Header | TierFSError]:
        for r in reqs:
            if isinstance(r, _Req):
                r.cap = self._cap_for(r.op, r.key)
        out = await self._batch1(reqs, timeout)
        redo = [i for i, (r, res) in enumerate(zip(reqs, out, strict=True))
                if isinstance(res, TierFSError) and isinstance(r, _Req) and self._retry_cap(res, r.cap)]
        if not redo:
            return out
        # Expired (or never had one): one fresh capability per inode/pool, then those again.
        scopes: dict[tuple[int, int, int], _Req] = {}
        for i in redo:
            r = reqs[i]
            assert isinstance(r, _Req)
            scopes.setdefault((r.key[0] if isinstance(r.key, tuple) else r.key.inode,
                               int(r.op in KV_OPS), int(r.op in _READ_OPS)), r)
        for r in scopes.values():
            with contextlib.suppress(TierFSError):  # the retry answers with the refusal again
                await self._refresh_cap(r.op, r.key)
        again: list[_Req | TierFSError] = []
        for i in redo:
            r = reqs[i]
            assert isinstance(r, _Req)
            r.cap = self._cap_for(r.op, r.key)
            again.append(r)
        for i, res in zip(redo, await self._batch1(again, timeout), strict=True):
            out[i] = res
        return out

    async def _batch1(self, reqs: list[_Req | TierFSError], timeout: float | None) -> list[Header | TierFSError]:
        t = self.request_timeout if timeout is None else timeout
        out: list[Header | TierFSError] = [r if isinstance(r, TierFSError) else _UNSET for r in reqs]
        groups: dict[tuple[str, int], list[int]] = {}
        for i, r in enumerate(reqs):
            if isinstance(r, _Req):
                addr = self.routes.get(r.target)
                if addr is None:
                    out[i] = UnavailableError(f"no data-plane address known for target {r.target}")
                else:
                    groups.setdefault(addr, []).append(i)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + t

        async def one(addr: tuple[str, int], idx: list[int]) -> None:
            try:
                async with asyncio.timeout_at(deadline):
                    conn = await self._pool(reqs[idx[0]].target).get()  # type: ignore[union-attr]
                got = await conn.call_many([reqs[i] for i in idx],  # type: ignore[misc]
                                           max(0.0, deadline - loop.time()))
            except TimeoutError:
                got = [TimeoutError_(f"connecting to {addr[0]}:{addr[1]} timed out")] * len(idx)
            except TierFSError as exc:
                got = [exc] * len(idx)
            for i, r in zip(idx, got, strict=True):
                out[i] = r

        await asyncio.gather(*(one(a, idx) for a, idx in groups.items()))
        return out

    # --- KV objects (ops KV_*; see tierfs.net.protocol) ------------------------

    async def kv_put(self, target: int, pool: int, key: bytes, value: memoryview, *, crc: int | None = None,
                     flags: int = 0, ttl_ms: int = 0, pin_ttl_ms: int = 0, timeout: float | None = None) -> bool:
        """Store ``value`` under ``key`` in KV pool ``pool`` on ``target``;
        False if it was there already (a no-op unless KV_OVERWRITE)."""
        if len(value) > self.limits.max_frame_bytes:
            raise InvalidArgumentError(
                f"KV object of {len(value)} bytes exceeds the frame limit {self.limits.max_frame_bytes}")
        r = _kv_put_req((target, pool, key, value, crc, flags, ttl_ms), pin_ttl_ms)
        hdr, _ = await self._call(target, Op.KV_PUT, r.key, timeout, offset=r.offset, length=r.length,
                                  payload=r.payload, payload2=r.payload2, crc=r.crc)
        return bool(hdr.length)

    async def kv_get_into(self, target: int, pool: int, key: bytes, dest: memoryview, *,
                          timeout: float | None = None, ttls: list[int] | None = None, since: int = 0,
                          crcs: list[int] | None = None) -> int | None:
        """Fetch ``key`` straight into ``dest``: its size, or None on a miss.
        The answer's CRC32C is the object's stored one, checked on arrival.
        ``ttls``, if given, gets the milliseconds the object has left to live
        appended (0: no TTL, or a miss). ``since``: an object put with an
        earlier placement stamp is a miss. ``crcs``, if given, gets the
        answer's CRC32C appended (0 for a miss)."""
        hdr, _ = await self._call(target, Op.KV_GET, (pool, 0, since << KV_STAMP_SHIFT, 0), timeout,
                                  length=min(len(dest), self.limits.max_frame_bytes), payload=memoryview(key),
                                  dest=dest)
        if ttls is not None:
            ttls.append(hdr.chunk if hdr.length else 0)
        if crcs is not None:
            crcs.append(hdr.payload_crc if hdr.length else 0)
        return hdr.payload_len if hdr.length else None

    async def kv_size(self, target: int, pool: int, key: bytes, *, timeout: float | None = None,
                      ttls: list[int] | None = None, since: int = 0) -> int | None:
        """The size of ``key``'s object on ``target`` without its bytes (a
        KV_GET with KV_SIZE_ONLY), or None on a miss. ``ttls``: as for
        ``kv_get_into``."""
        hdr, _ = await self._call(target, Op.KV_GET, (pool, 0, KV_SIZE_ONLY | since << KV_STAMP_SHIFT, 0), timeout,
                                  length=0,
                                  payload=memoryview(key))
        if ttls is not None:
            ttls.append(hdr.chunk if hdr.length else 0)
        return hdr.offset if hdr.length else None

    async def kv_get(self, target: int, pool: int, key: bytes, *, timeout: float | None = None,
                     ttls: list[int] | None = None, since: int = 0, crcs: list[int] | None = None) -> bytes | None:
        """The value of ``key`` (any size up to the frame limit), or None.
        ``ttls``, ``since``, ``crcs``: as for ``kv_get_into``."""
        hdr, body = await self._call(target, Op.KV_GET, (pool, 0, since << KV_STAMP_SHIFT, 0), timeout,
                                     length=self.limits.max_frame_bytes, payload=memoryview(key))
        if ttls is not None:
            ttls.append(hdr.chunk if hdr.length else 0)
        if crcs is not None:
            crcs.append(hdr.payload_crc if hdr.length else 0)
        if not hdr.length:
            return None
        return bytes(body) if body is not None else b""

    async def kv_exists(self, target: int, pool: int, keys: Sequence[bytes], *,
                        timeout: float | None = None, since: int = 0) -> list[bool]:
        """Which of ``keys`` ``target`` holds: one request for all of them
        (those put with a placement stamp before ``since`` do not count)."""
        from tierfs.net.protocol import pack_keys

        _hdr, body = await self._call(target, Op.KV_EXISTS, (pool, 0, since << KV_STAMP_SHIFT, 0), timeout,
                                      offset=len(keys),
                                      payload=memoryview(pack_keys(list(keys))))
        bits = bytes(body or b"")
        if len(bits) != (len(keys) + 7) // 8:
            raise ProtocolError(f"KV_EXISTS answer of {len(bits)} bytes for {len(keys)} keys")
        v = int.from_bytes(bits, "little")
        return [bool((v >> i) & 1) for i in range(len(keys))]

    async def kv_crcs(self, target: int, pool: int, keys: Sequence[bytes], *,
                      timeout: float | None = None, since: int = 0) -> list[int | None] | None:
        """The stored CRC32C of each of ``keys`` on ``target`` (None where
        absent, as for ``kv_exists``): one KV_EXISTS with KV_WITH_CRC, no
        I/O on the daemon. None: the daemon is of a release before stop 39
        and answered presence alone."""
        from tierfs.net.protocol import pack_keys

        _hdr, body = await self._call(target, Op.KV_EXISTS, (pool, 0, KV_WITH_CRC | since << KV_STAMP_SHIFT, 0),
                                      timeout, offset=len(keys), payload=memoryview(pack_keys(list(keys))))
        raw = bytes(body or b"")
        if len(raw) == (len(keys) + 7) // 8:
            return None  # a bitmap: the daemon does not know the flag
        if len(raw) != 8 * len(keys):
            raise ProtocolError(f"KV_EXISTS (with CRCs) answer of {len(raw)} bytes for {len(keys)} keys")
        out: list[int | None] = []
        for i in range(len(keys)):
            w = int.from_bytes(raw[8 * i: 8 * i + 8], "little")
            out.append(w & 0xFFFFFFFF if w & KV_PRESENT else None)
        return out

    async def kv_delete(self, target: int, pool: int, key: bytes, *, timeout: float | None = None,
                        since: int = 0, group: bool = False) -> bool:
        """Delete ``key`` there; ``since``: the placement stamp of the
        deleter's map for this copy (the daemon refuses, StaleVersionError,
        when its newer map places the key elsewhere; 0: not checked), or,
        ``group``, its group stamp (KV_GROUP: refused also when the daemon's
        map has a later one)."""
        flags = since << KV_STAMP_SHIFT | (KV_GROUP if group and since else 0)
        hdr, _ = await self._call(target, Op.KV_DELETE, (pool, 0, flags, 0), timeout,
                                  payload=memoryview(key))
        return bool(hdr.length)

    async def kv_pin(self, target: int, pool: int, key: bytes, kind: int, ttl_ms: int = 0, *,
                     timeout: float | None = None, since: int = 0, group: int = 0) -> bool:
        """Pin (kind 1 soft, 2 hard) or unpin (kind 0) ``key``; False if
        absent. ``since``: the placement stamp of the pinner's map for this
        copy, as for :meth:`kv_delete`; ``group``: its group stamp (the
        daemon refuses, StaleVersionError, when its map has a later one;
        0: not checked)."""
        hdr, _ = await self._call(target, Op.KV_PIN, (pool, since, kind, group), timeout, length=ttl_ms,
                                  payload=memoryview(key))
        return bool(hdr.length)

    async def kv_put_batch(self, items: Iterable[KVPutItem], *,
                           timeout: float | None = None) -> list[bool | TierFSError]:
        """Many ``kv_put`` at once: the frames for one server go out in one
        ``writelines``. Results in item order: stored, or the error."""
        reqs: list[_Req | TierFSError] = []
        for it in items:
            if len(it[3]) > self.limits.max_frame_bytes:
                reqs.append(InvalidArgumentError(
                    f"KV object of {len(it[3])} bytes exceeds the frame limit {self.limits.max_frame_bytes}"))
            else:
                reqs.append(_kv_put_req(it))
        res = await self._batch(reqs, timeout)
        return [bool(r.length) if isinstance(r, Header) else r for r in res]

    async def kv_get_batch(self, items: Iterable[KVGetItem], *, timeout: float | None = None,
                           ttls: list[int] | None = None,
                           crcs: list[int] | None = None) -> list[int | TierFSError | None]:
        """Many ``kv_get_into`` at once; results in item order: the size,
        None for a miss, or the error. ``ttls`` and ``crcs``, if given, get
        one entry per item appended, as for ``kv_get_into`` (0 for an error
        too)."""
        reqs: list[_Req | TierFSError] = [
            _Req(Op.KV_GET, it[0], (it[1], 0, it[4] << KV_STAMP_SHIFT if len(it) > 4 else 0, 0),  # type: ignore[misc]
                 length=min(len(it[3]), self.limits.max_frame_bytes), payload=memoryview(it[2]), dest=it[3])
            for it in items]
        res = await self._batch(reqs, timeout)
        if ttls is not None:
            ttls.extend(r.chunk if isinstance(r, Header) and r.length else 0 for r in res)
        if crcs is not None:
            crcs.extend(r.payload_crc if isinstance(r, Header) and r.length else 0 for r in res)
        return [(r.payload_len if r.length else None) if isinstance(r, Header) else r for r in res]

    def begin_close(self) -> list[asyncio.Future[Any]]:
        """Close every pool now, without waiting (see ``_PeerPool.begin_close``);
        returns what to wait for."""
        self._closed = True
        pools, self._pools = list(self._pools.values()), {}
        return [w for p in pools for w in p.begin_close()]

    async def close(self) -> None:
        # Everything is closed before the first await: a close cancelled
        # while it waits (a task cancelled during its cleanup) leaks nothing.
        waits = self.begin_close()
        if waits:
            await asyncio.gather(*waits, return_exceptions=True)

    async def __aenter__(self) -> DataClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
