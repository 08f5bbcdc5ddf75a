"""The data-plane server: serves FragmentStores (keyed by target id) over the
framed protocol of :mod:`tierfs.net.protocol`, on every configured transport.

Per connection: requests run concurrently and are answered out of order; a
WRITE payload is received straight into ``store.alloc(n)`` and handed to the
store only after its CRC32C checks out; a READ answer sends the store's buffer
as is (``writelines([header, view])``) and gives it back to the store once the
transport has flushed it. Limits on in-flight bytes and requests pause reading
from the connection (backpressure, never an error). A protocol violation
closes that connection with a logged reason and touches no store.

Standalone (tests, benchmarks)::

    python -m tierfs.storage.dataplane --memory-target 1 [--disk-target 2:/path] [--port 0]

prints ``{"port": N}`` on stdout once listening, and runs until stdin closes
or SIGTERM.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from tierfs.capability import (
    KIND_FILE,
    KIND_KV,
    KIND_NODE,
    OP_READ,
    OP_WRITE,
    Capability,
    Keyring,
    check_scope,
    session_of_generation,
    verify,
)
from tierfs.errors import (
    CapabilityExpiredError,
    InternalError,
    InvalidArgumentError,
    ProtocolError,
    StaleVersionError,
    TierFSError,
    UnauthenticatedError,
    UnavailableError,
)
from tierfs.net.framing import FrameProtocol, log
from tierfs.net.protocol import (
    ALL,
    F_RESPONSE,
    HEADER_SIZE,
    KV_GROUP,
    KV_OPS,
    KV_OVERWRITE,
    KV_PIN_SHIFT,
    KV_PRESENT,
    KV_SIZE_ONLY,
    KV_STAMP_SHIFT,
    KV_WITH_CRC,
    MAX_CAP_PAYLOAD,
    MAX_CAP_SLOTS,
    MAX_KV_EXISTS_KEYS,
    MAX_KV_KEY,
    PAYLOAD_OPS,
    SERIAL,
    Header,
    Limits,
    Op,
    crc32c,
    encode_header,
    unpack_keys,
)
from tierfs.net.transport import Listener, get_transport
from tierfs.storage.api import FragmentStore, KVTargetStore

__all__ = ["DataPlaneServer", "start_dataplane"]


class _Releaser(Protocol):
    def release(self, buf: memoryview) -> None: ...


_MAX_ERROR_MESSAGE = 4096
_COUNTERS = (
    "connections_total", "connections_active", "protocol_violations", "requests_total",
    "requests_failed", "bytes_received", "bytes_sent", "reads", "writes", "deletes", "stats", "pings",
    "kv_puts", "kv_gets", "kv_hits", "kv_exists", "kv_deletes", "kv_pins",
    # KV puts and deletes refused because this daemon's newer map places the
    # key in another group (the client's map is older: it refreshes and
    # tries again).
    "kv_puts_misplaced", "kv_deletes_misplaced", "kv_pins_misplaced",
    # KV puts and deletes refused because the writer's group stamp is older
    # than this daemon's for the key's group: a copy the writer skipped (its
    # map calls it down) came back or was replaced since.
    "kv_group_behind",
    # KV puts, deletes and pins refused because the key's position on this
    # target has a later placement stamp in this daemon's map than in the
    # writer's: the target lost the position and got it back since (a
    # write from before that, a late one included, may be older than what
    # was written meanwhile elsewhere).
    "kv_stamp_behind",
    # KV map leases (docs/kv.md, "Map leases"): gets and exists answered as
    # misses without a lease, requests refused when it ran out, requests
    # whose key's placement changed while they ran.
    "kv_lease_misses", "kv_lease_refusals", "kv_moved_during",
    # Capabilities (docs/security-caps.md): CAP frames, and requests refused
    # by reason (no capability, forged/malformed, expired, another inode's or
    # pool's, the wrong operation, no keys from meta yet).
    "cap_frames", "cap_frames_refused", "cap_refused_missing", "cap_refused_forged", "cap_refused_expired",
    "cap_refused_scope", "cap_refused_op", "cap_refused_nokeys",
)
#: Counter of each refusal reason (Prometheus: tierfs_dataplane_cap_refusals).
CAP_REFUSALS = ("missing", "forged", "expired", "scope", "op", "nokeys")
_READ_OPS = frozenset({int(Op.READ), int(Op.STAT), int(Op.KV_GET), int(Op.KV_EXISTS)})
#: op -> (capability kind, operation) it needs
_NEEDS = {int(o): (KIND_KV if int(o) in KV_OPS else KIND_FILE, OP_READ if int(o) in _READ_OPS else OP_WRITE)
          for o in Op}
_TENANT_BYTES = 8


def tenant_key(tenant: int, key: bytes) -> bytes:
    """A KV key as the store keeps it: the tenant (8 bytes, big-endian) of
    the capability it was addressed with, then the user's key."""
    return tenant.to_bytes(_TENANT_BYTES, "big") + key
#: Largest key payload of a KV_GET / KV_DELETE / KV_PIN request.
_MAX_KEY_PAYLOAD = MAX_KV_KEY
#: Largest KV_EXISTS payload (every key at the longest).
_MAX_EXISTS_PAYLOAD = MAX_KV_EXISTS_KEYS * (MAX_KV_KEY + 2)



class _ServerConnection(FrameProtocol):
    role = "server"

    def __init__(self, server: DataPlaneServer) -> None:
        super().__init__(server.limits)
        self.server = server
        self.counters = server.counters
        self._inflight_requests = 0
        self._inflight_bytes = 0
        self._paused = False
        # Buffers (with their store) referenced by the transport's send queue.
        self._unsent: collections.deque[tuple[_Releaser, memoryview, int]] = collections.deque()
        self._write_paused = False
        # Answer pieces queued for the next flush, and the read buffers among them.
        self._out: list[bytes | bytearray | memoryview] = []
        self._lent: list[tuple[_Releaser, memoryview, int]] = []
        self._flush_scheduled = False
        # Which store owns the buffer of the frame being received (WRITE).
        self._recv_store: FragmentStore | None = None
        # Why the payload being received is drained instead of stored (a full
        # buffer pool, say): answered as this error once the frame is complete.
        self._recv_error: TierFSError | None = None
        # KV_PUT being received: its KV store, the value buffer (from that
        # store) and the key buffer after it (a scattered payload).
        self._recv_kv: KVTargetStore | None = None
        self._recv_value: memoryview | None = None
        self._recv_key: memoryview | None = None
        # Verified capabilities (or why the one sent was refused) by slot.
        self.caps: dict[int, Capability | TierFSError] = {}
        # The KV tenant of the frame being received (from its capability).
        self._recv_tenant = 0

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        # high=0: the transport calls pause_writing whenever anything is left
        # unsent and resume_writing once it is all out; that is our signal
        # that read buffers can go back to the store.
        transport.set_write_buffer_limits(high=0, low=0)
        self.server._conns.add(self)
        self.counters["connections_total"] += 1
        self.counters["connections_active"] += 1

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._release_unsent()
        self._maybe_resume()

    def _on_lost(self, exc: Exception | None) -> None:
        self.server._conns.discard(self)
        self.counters["connections_active"] -= 1
        # A write payload cut off mid-way goes back to its store. Requests
        # already handed to a store run to completion (a store operation is
        # not safe to interrupt half-way); their answers are dropped.
        if self._payload is not None and self._recv_store is not None:
            self._recv_store.release(self._payload)
        self._payload = None
        self._recv_store = None
        self._drop_kv_recv()
        self._unsent.extend(self._lent)
        self._lent.clear()
        self._out.clear()
        self._release_unsent(force=True)

    def _on_violation(self, reason: str) -> None:
        self.counters["protocol_violations"] += 1

    def _on_bad_payload(self, hdr: Header, payload: memoryview) -> None:
        if hdr.op == Op.KV_PUT:
            self._drop_kv_recv()
            return
        store, self._recv_store = self._recv_store, None
        if store is not None:
            store.release(payload)

    def _drop_kv_recv(self) -> None:
        kv, value = self._recv_kv, self._recv_value
        self._recv_kv = self._recv_value = self._recv_key = None
        if kv is not None and value is not None:
            kv.release(value)

    def _kv_header(self, hdr: Header) -> memoryview | tuple[memoryview, memoryview] | None:
        if hdr.op != Op.KV_PUT:
            limit = _MAX_EXISTS_PAYLOAD if hdr.op == Op.KV_EXISTS else _MAX_KEY_PAYLOAD
            if hdr.payload_len > limit:
                raise ProtocolError(f"{Op(hdr.op).name} payload of {hdr.payload_len} bytes (at most {limit})")
            if self._recv_error is not None:
                return None
            return memoryview(bytearray(hdr.payload_len))
        klen = hdr.offset
        if not 0 < klen <= MAX_KV_KEY or klen > hdr.payload_len:
            raise ProtocolError(f"KV_PUT key length {klen} (1..{MAX_KV_KEY}, within a {hdr.payload_len}-byte payload)")
        if self._recv_error is not None:
            return None  # refused (capability): drained, nothing stored
        kv = self.server.kvstores.get(hdr.target)
        if kv is None:
            return None  # drained and answered with an error in _serve
        try:
            value = kv.alloc(hdr.payload_len - klen)
        except TierFSError as exc:
            self._recv_error = exc
            return None
        key = memoryview(bytearray(klen))
        self._recv_kv, self._recv_value, self._recv_key = kv, value, key
        return value, key

    # --- receive ---------------------------------------------------------------

    def _on_header(self, hdr: Header) -> memoryview | tuple[memoryview, memoryview] | None:
        if hdr.flags & F_RESPONSE:
            raise ProtocolError(f"response frame (op {hdr.op}) sent to the server")
        if hdr.op not in PAYLOAD_OPS:
            raise ProtocolError(f"op {Op(hdr.op).name} carries no payload, got {hdr.payload_len} bytes")
        if hdr.op == Op.CAP:
            if hdr.payload_len > MAX_CAP_PAYLOAD:
                raise ProtocolError(f"CAP payload of {hdr.payload_len} bytes (at most {MAX_CAP_PAYLOAD})")
            return memoryview(bytearray(hdr.payload_len))
        # The capability is checked before anything is allocated from a
        # store: a refused request's payload is drained and dropped.
        self._recv_error, self._recv_tenant = self._authorize(hdr)
        if hdr.op in KV_OPS:
            return self._kv_header(hdr)
        if self._recv_error is not None:
            self._recv_store = None
            return None
        store = self.server.stores.get(hdr.target)
        if store is None:
            self._recv_store = None
            return None  # drained and answered with an error in _on_frame
        try:
            buf = store.alloc(hdr.payload_len)
        except TierFSError as exc:
            # Drain the payload and answer with the error; the connection and
            # the other requests on it carry on.
            self._recv_store = None
            self._recv_error = exc
            return None
        self._recv_store = store
        return buf

    def _on_frame(self, hdr: Header, payload: memoryview | None) -> None:
        if hdr.flags & F_RESPONSE:
            raise ProtocolError(f"response frame (op {hdr.op}) sent to the server")
        if hdr.op not in PAYLOAD_OPS and hdr.payload_len:
            raise ProtocolError(f"op {hdr.op} carries no payload")
        if hdr.op == Op.CAP:
            self.counters["requests_total"] += 1
            self._on_cap(hdr, payload)
            return
        if not hdr.payload_len:
            # No payload, so _on_header did not run: check here.
            self._recv_error, self._recv_tenant = self._authorize(hdr)
        store = self._recv_store
        self._recv_store = None
        error, self._recv_error = self._recv_error, None
        tenant = self._recv_tenant
        kv_put: tuple[KVTargetStore, memoryview, memoryview] | None = None
        if hdr.op == Op.KV_PUT and self._recv_kv is not None:
            assert self._recv_value is not None and self._recv_key is not None
            kv_put = (self._recv_kv, self._recv_value, self._recv_key)
            self._recv_kv = self._recv_value = self._recv_key = None
        self.counters["requests_total"] += 1
        self.counters["bytes_received"] += hdr.payload_len
        reserve = hdr.payload_len
        if hdr.op in (Op.READ, Op.KV_GET) and hdr.length != ALL:
            reserve += min(hdr.length, self.limits.max_frame_bytes)
        self._inflight_requests += 1
        self._inflight_bytes += reserve
        if hdr.op in KV_OPS:
            task = asyncio.get_running_loop().create_task(
                self._serve_kv(hdr, payload, kv_put, reserve, error, tenant))
        else:
            task = asyncio.get_running_loop().create_task(self._serve(hdr, payload, store, reserve, error))
        self.server._tasks.add(task)
        task.add_done_callback(self.server._tasks.discard)
        if not self._paused and self._over_limit():
            self._paused = True
            self.transport.pause_reading()

    def _over_limit(self) -> bool:
        # Answers the peer is not reading count too, or a client that never
        # reads could make us queue headers without bound.
        return (self._inflight_requests >= self.limits.max_inflight_requests
                or self._inflight_bytes >= self.limits.max_inflight_bytes
                or self.transport.get_write_buffer_size() >= self.limits.max_inflight_bytes)

    def _done(self, reserve: int) -> None:
        self._inflight_requests -= 1
        self._inflight_bytes -= reserve
        self._maybe_resume()

    def _maybe_resume(self) -> None:
        if self._paused and not self.closed and not self._over_limit():
            self._paused = False
            self.transport.resume_reading()

    # --- capabilities ------------------------------------------------------------

    def _on_cap(self, hdr: Header, payload: memoryview | None) -> None:
        self.counters["cap_frames"] += 1
        slot = hdr.status
        server = self.server
        try:
            if not 1 <= slot <= MAX_CAP_SLOTS:
                raise InvalidArgumentError(f"capability slot {slot} (1..{MAX_CAP_SLOTS})")
            if not server.require_capabilities:
                self._reply(hdr)  # nothing is checked here: accepted and ignored
                return
            if not server.keyring:
                # Not stored: once the keys arrive, the client's next CAP works.
                self.caps.pop(slot, None)
                raise UnavailableError("this storage node has no capability keys from meta yet; retry shortly")
            try:
                cap = verify(server.keyring, int(time.time() * 1000), payload if payload is not None else b"")
            except TierFSError as exc:
                self.caps[slot] = exc  # the requests naming this slot get the same answer
                raise
            self.caps[slot] = cap
            self._reply(hdr)
        except TierFSError as exc:
            self.counters["cap_frames_refused"] += 1
            log.info("capability refused from %s: %s", self.peer, exc.message,
                     extra={"event": "dataplane.cap_refused", "peer": self.peer, "reason": exc.message})
            self._reply_error(hdr, exc)

    def _authorize(self, hdr: Header) -> tuple[TierFSError | None, int]:
        """Whether the capability in the request's slot allows it: (None,
        KV tenant) or (the refusal, 0). A dict lookup and integer compares;
        the HMAC was checked once, when the CAP frame came."""
        server = self.server
        op = hdr.op
        if not server.require_capabilities or op == Op.PING:
            return None, 0
        c = self.caps.get(hdr.status) if hdr.status else None
        counters = self.counters
        if c is None:
            if not server.keyring:
                counters["cap_refused_nokeys"] += 1
                return UnavailableError("this storage node has no capability keys from meta yet; retry shortly"), 0
            counters["cap_refused_missing"] += 1
            why = f"slot {hdr.status} holds none on this connection" if hdr.status else "none sent"
            return UnauthenticatedError(f"{Op(op).name} needs a capability ({why})"), 0
        if not isinstance(c, Capability):
            counters["cap_refused_expired" if isinstance(c, CapabilityExpiredError) else "cap_refused_forged"] += 1
            return c, 0
        if c.expiry_ms <= time.time() * 1000:
            counters["cap_refused_expired"] += 1
            return CapabilityExpiredError(f"{c.describe()} has expired; fetch a fresh one from meta"), 0
        kind, need = _NEEDS[op]
        if c.ops & need:
            if c.kind == kind and c.scope == hdr.inode and (kind == KIND_KV or (
                    c.lo <= hdr.chunk < c.hi and (need == OP_READ or not c.session
                                                  or session_of_generation(hdr.fversion) == c.session))):
                return None, c.principal
            if c.kind == KIND_NODE and kind == KIND_FILE:
                return None, 0
        err = check_scope(c, kind, hdr.inode, need, hdr.chunk, hdr.fversion)
        if err is None:  # pragma: no cover - the fast path above accepts all of these
            return None, c.principal
        in_scope = check_scope(c, kind, hdr.inode, c.ops, hdr.chunk, hdr.fversion) is None
        counters["cap_refused_op" if in_scope else "cap_refused_scope"] += 1
        return err, 0

    # --- serve -----------------------------------------------------------------

    async def _serve(self, hdr: Header, payload: memoryview | None, wstore: FragmentStore | None, reserve: int,
                     error: TierFSError | None = None) -> None:
        out: memoryview | None = None
        ostore: _Releaser | None = None
        try:
            if error is not None:
                raise error
            store = self.server.stores.get(hdr.target)
            if store is None:
                raise UnavailableError(f"target {hdr.target} is not served here")
            op = hdr.op
            if op == Op.WRITE:
                self.counters["writes"] += 1
                data = payload if payload is not None else memoryview(b"")
                await store.write(hdr.key, data, hdr.payload_crc)
                self._reply(hdr)
            elif op == Op.READ:
                self.counters["reads"] += 1
                if hdr.length != ALL and hdr.length > self.limits.max_frame_bytes:
                    raise InvalidArgumentError(
                        f"read of {hdr.length} bytes exceeds the frame limit {self.limits.max_frame_bytes}")
                length = -1 if hdr.length == ALL else hdr.length
                # Optional store extension: a store that verified the whole
                # fragment against its stored CRC32C hands that CRC over, and
                # the answer needs no second pass over the bytes.
                # A store that knows its fragment files' serials says which
                # file the bytes came from (docs/dataplane.md, "Serials").
                read_with_info = getattr(store, "read_with_info", None)
                read_with_crc = getattr(store, "read_with_crc", None)
                crc: int | None = None
                serial = 0
                if read_with_info is not None:
                    out, crc, serial = await read_with_info(hdr.key, hdr.offset, length)
                elif read_with_crc is not None:
                    out, crc = await read_with_crc(hdr.key, hdr.offset, length)
                else:
                    out = await store.read(hdr.key, hdr.offset, length)
                ostore = store
                if len(out) > self.limits.max_frame_bytes:
                    raise InvalidArgumentError(
                        f"fragment range of {len(out)} bytes exceeds the frame limit {self.limits.max_frame_bytes}")
                self._reply(hdr, payload=out, store=store, payload_crc=crc, length=SERIAL | serial if serial else 0)
                out = None  # owned by the send queue now
            elif op == Op.DELETE:
                self.counters["deletes"] += 1
                existed = await store.delete(hdr.key)
                self._reply(hdr, length=1 if existed else 0)
            elif op == Op.STAT:
                self.counters["stats"] += 1
                info = await store.stat(hdr.key)
                self._reply(hdr, length=info.size, payload_crc=info.crc32c,
                            offset=SERIAL | info.serial if info.serial else hdr.offset)
            elif op == Op.PING:  # pragma: no branch
                self.counters["pings"] += 1
                self._reply(hdr)
        except asyncio.CancelledError:
            raise
        except TierFSError as exc:
            self.counters["requests_failed"] += 1
            self._reply_error(hdr, exc)
        except Exception as exc:
            self.counters["requests_failed"] += 1
            log.exception("dataplane request failed", extra={
                "event": "dataplane.internal_error", "op": hdr.op, "target": hdr.target, "peer": self.peer})
            self._reply_error(hdr, InternalError(f"{type(exc).__name__}: {exc}"))
        finally:
            if out is not None and ostore is not None:
                ostore.release(out)
            if payload is not None and wstore is not None:
                wstore.release(payload)
            self._done(reserve)

    async def _serve_kv(self, hdr: Header, payload: memoryview | None,
                        put: tuple[KVTargetStore, memoryview, memoryview] | None, reserve: int,
                        error: TierFSError | None = None, tenant: int = 0) -> None:
        op = hdr.op
        try:
            if error is not None:
                raise error
            kv = self.server.kvstores.get(hdr.target)
            if kv is None:
                raise UnavailableError(f"target {hdr.target} serves no KV store here")
            pool = hdr.inode
            hook = self.server.on_unknown_kv_pool
            if hook is not None and not kv.has_pool(pool):
                # A pool created a moment ago: the daemon has not seen the map
                # that names it yet. Look now rather than at the next heartbeat.
                await hook(pool)
            if op == Op.KV_PUT:
                self.counters["kv_puts"] += 1
                if put is None:
                    raise InvalidArgumentError("KV_PUT without a key")
                _, value, keybuf = put
                key = bytes(keybuf)
                # The frame CRC covered value || key; this ties the value's own
                # CRC (which the store keeps) to it without a pass over the value.
                if crc32c(key, hdr.fversion) != hdr.payload_crc:
                    raise InvalidArgumentError("KV_PUT value CRC32C does not match its payload")
                flags = hdr.fragment
                stamp = asked = flags >> KV_STAMP_SHIFT
                gate = self.server.kv_gate
                grouped = bool(flags & KV_GROUP)
                if gate is not None and stamp:
                    if grouped:
                        self._kv_group_check(pool, key, asked, "put")
                    # A writer whose map is older than a change that moved the
                    # key would leave its value where no up-to-date reader
                    # looks, and those readers would go on finding an older
                    # value in the key's new group: refuse it, and the writer
                    # refreshes its map and puts again (docs/kv.md). So is one
                    # whose map is older than this position's placement stamp
                    # (_kv_admit): the copy is stamped with the writer's stamp.
                    need = await self._kv_admit(pool, hdr.target, key, stamp)
                    if need is None:
                        self.counters["kv_puts_misplaced"] += 1
                        raise StaleVersionError(
                            f"KV pool {pool}: target {hdr.target} is not in this key's group in the daemon's map, "
                            "which is newer than the writer's; refresh the map and put again")
                    if grouped:
                        # Again: the admission may have waited (for a lease, or
                        # for a change to take effect), and the map moved meanwhile.
                        self._kv_group_check(pool, key, asked, "put")
                    stamp = need
                put = None  # the store owns the value buffer from here on
                stored = await kv.put(pool, tenant_key(tenant, key), value, hdr.fversion, overwrite=bool(flags & KV_OVERWRITE),
                                      ttl_ms=hdr.chunk, pin=(flags >> KV_PIN_SHIFT) & 3, pin_ttl_ms=hdr.length,
                                      stamp=stamp)
                if gate is not None and stamp:
                    self._kv_still(pool, hdr.target, key, asked, stamp, grouped=grouped)
                self._reply(hdr, length=1 if stored else 0)
                return
            if payload is None:
                raise InvalidArgumentError(f"{Op(op).name} without a key")
            if op == Op.KV_GET:
                self.counters["kv_gets"] += 1
                asked = hdr.fragment >> KV_STAMP_SHIFT
                since: int | None = asked
                gate = self.server.kv_gate
                if gate is not None:
                    since = gate(pool, hdr.target, bytes(payload), asked) if self._kv_leased(asked) else None
                got = None if since is None else await kv.get_with_ttl(pool, tenant_key(tenant, bytes(payload)), since)
                if got is not None and gate is not None and asked and not self._kv_served(
                        pool, hdr.target, bytes(payload), asked, since or 0):
                    # The map moved, or the lease ran out, during the read.
                    kv.release(got[0])
                    got = None
                if got is None:
                    self._reply(hdr, length=0)
                    return
                view, crc, ttl_left = got
                if hdr.fragment & KV_SIZE_ONLY:
                    n = len(view)
                    kv.release(view)
                    self.counters["kv_hits"] += 1
                    self._reply(hdr, length=1, offset=n, chunk=ttl_left)
                    return
                if len(view) > hdr.length or len(view) > self.limits.max_frame_bytes:
                    n = len(view)
                    kv.release(view)
                    raise InvalidArgumentError(f"KV object of {n} bytes does not fit the {hdr.length}-byte buffer"
                                               if n <= self.limits.max_frame_bytes else
                                               f"KV object of {n} bytes exceeds the frame limit")
                self.counters["kv_hits"] += 1
                self._reply(hdr, payload=view, store=kv, length=1, payload_crc=crc, chunk=ttl_left)
            elif op == Op.KV_EXISTS:
                self.counters["kv_exists"] += 1
                try:
                    keys = unpack_keys(payload, hdr.offset)
                except ProtocolError as exc:
                    raise InvalidArgumentError(str(exc)) from None
                least = hdr.fragment >> KV_STAMP_SHIFT
                gate = self.server.kv_gate
                tkeys = [tenant_key(tenant, k) for k in keys]
                if hdr.fragment & KV_WITH_CRC:
                    # Each key's stored CRC32C (a replica get's witness), as a
                    # u64: KV_PRESENT | crc, or 0 where absent.
                    if gate is None:
                        crcs = kv.crcs(pool, tkeys, least)
                    else:
                        leased = self._kv_leased(least)
                        needs = [gate(pool, hdr.target, k, least) if leased else None for k in keys]
                        crcs = [None if need is None else c for need, c in zip(needs, kv.crcs(
                            pool, tkeys, [least if need is None else need for need in needs]), strict=True)]
                    words = b"".join((0 if c is None else KV_PRESENT | c).to_bytes(8, "little") for c in crcs)
                    self._reply(hdr, payload=memoryview(words), store=_NOT_POOLED, length=len(keys))
                    return
                if gate is None:
                    present = kv.contains(pool, tkeys, least)
                else:
                    leased = self._kv_leased(least)
                    needs = [gate(pool, hdr.target, k, least) if leased else None for k in keys]
                    present = [need is not None and hit for need, hit in zip(needs, kv.contains(
                        pool, tkeys, [least if need is None else need for need in needs]), strict=True)]
                bits = 0
                for i, hit in enumerate(present):
                    if hit:
                        bits |= 1 << i
                bitmap = bits.to_bytes((len(keys) + 7) // 8, "little")
                self._reply(hdr, payload=memoryview(bitmap), store=_NOT_POOLED, length=len(keys))
            elif op == Op.KV_DELETE:
                self.counters["kv_deletes"] += 1
                stamp = hdr.fragment >> KV_STAMP_SHIFT
                gate = self.server.kv_gate
                grouped = bool(hdr.fragment & KV_GROUP)
                need = None
                if gate is not None and stamp:
                    if grouped:
                        self._kv_group_check(pool, bytes(payload), stamp, "delete")
                    need = await self._kv_admit(pool, hdr.target, bytes(payload), stamp)
                    if need is None:
                        # As for a put: a deleter with an older map would leave
                        # the key's copy in its current group, served on.
                        self.counters["kv_deletes_misplaced"] += 1
                        raise StaleVersionError(
                            f"KV pool {pool}: target {hdr.target} is not in this key's group in the daemon's map, "
                            "which is newer than the deleter's; refresh the map and delete again")
                    if grouped:
                        self._kv_group_check(pool, bytes(payload), stamp, "delete")  # as for a put: again
                existed = await kv.delete(pool, tenant_key(tenant, bytes(payload)))
                if need is not None:
                    self._kv_still(pool, hdr.target, bytes(payload), stamp, need, grouped=grouped)
                self._reply(hdr, length=1 if existed else 0)
            elif op == Op.KV_PIN:  # pragma: no branch
                self.counters["kv_pins"] += 1
                gate = self.server.kv_gate
                if gate is not None and hdr.chunk and hdr.fversion:
                    # The pinner's group stamp (clients of stop 35 on, outside
                    # replica:1): as for a grouped delete.
                    self._kv_group_check(pool, bytes(payload), hdr.fversion, "pin")
                if gate is not None and hdr.chunk and await self._kv_admit(pool, hdr.target, bytes(payload),
                                                                           hdr.chunk) is None:
                    # As for a delete: a pinner with an older map would pin a
                    # copy outside the key's group and leave the served one bare.
                    self.counters["kv_pins_misplaced"] += 1
                    raise StaleVersionError(
                        f"KV pool {pool}: target {hdr.target} is not in this key's group in the daemon's map, "
                        "which is newer than the pinner's; refresh the map and pin again")
                if gate is not None and hdr.chunk and hdr.fversion:
                    self._kv_group_check(pool, bytes(payload), hdr.fversion, "pin")  # as for a put: again
                key = tenant_key(tenant, bytes(payload))
                found = kv.unpin(pool, key) if hdr.fragment == 0 else kv.pin(pool, key, hdr.fragment, hdr.length)
                self._reply(hdr, length=1 if found else 0)
        except asyncio.CancelledError:
            raise
        except TierFSError as exc:
            self.counters["requests_failed"] += 1
            self._reply_error(hdr, exc)
        except Exception as exc:
            self.counters["requests_failed"] += 1
            log.exception("dataplane KV request failed", extra={
                "event": "dataplane.internal_error", "op": hdr.op, "target": hdr.target, "peer": self.peer})
            self._reply_error(hdr, InternalError(f"{type(exc).__name__}: {exc}"))
        finally:
            if put is not None:
                put[0].release(put[1])
            self._done(reserve)

    # -- KV map leases (docs/kv.md, "Map leases") ----------------------------

    def _kv_leased(self, asked: int) -> bool:
        """Whether a stamped KV request may be served here now (a request
        without a stamp, from a release before stamps, is not checked); a
        get or exists of a node without a lease is a miss."""
        ok = self.server.kv_lease_ok
        if not asked or ok is None or ok():
            return True
        self.counters["kv_lease_misses"] += 1
        return False

    async def _kv_admit(self, pool: int, target: int, key: bytes, asked: int) -> int | None:
        """The stamp a put, delete or pin of ``key`` on ``target`` acts with
        (the gate's), once it may: the node holds a lease and meta says that
        stamp's map has taken effect everywhere (no node can still take the
        key where it was before). None when the daemon's map puts the key
        elsewhere."""
        gate = self.server.kv_gate
        settle = self.server.kv_settle
        assert gate is not None
        need = gate(pool, target, key, asked)
        for _ in range(3):
            if need is not None and need > asked:
                # This target lost the key's position and got it back after
                # the writer's map: what it writes may be older than what was
                # written elsewhere meanwhile (a request that sat in a stopped
                # daemon's socket, say). Stamped with the later stamp it would
                # be served again; refused, the writer refreshes its map and
                # writes once more if it still means to.
                self.counters["kv_stamp_behind"] += 1
                raise StaleVersionError(
                    f"KV pool {pool}: the key's position on target {target} has placement stamp {need} in the "
                    f"daemon's map, later than the writer's {asked}; refresh the map and try again")
            if need is None or settle is None:
                return need
            await settle(need)
            again = gate(pool, target, key, asked)  # the map may have moved meanwhile
            if again == need:
                return need
            need = again
        raise UnavailableError(f"KV pool {pool}: the key's placement kept changing; try again")

    def _kv_group_check(self, pool: int, key: bytes, asked: int, what: str) -> None:
        """A put or delete whose stamp is the writer's group stamp
        (KV_GROUP): refuse it when this daemon's map has a later one for the
        key's group. The writer's map is then older than a change to a
        position it may have skipped (a target it calls down came back, or
        was replaced), which would keep the value it overwrote, or deleted,
        and serve it to readers that ask there first (docs/kv.md, "Writers
        that skip a copy")."""
        group = self.server.kv_group
        if group is None:
            return
        latest = group(pool, key)
        if asked < latest:
            self.counters["kv_group_behind"] += 1
            raise StaleVersionError(
                f"KV pool {pool}: the key's group changed at map version {latest}, after the "
                f"{ {'put': 'writer', 'delete': 'deleter'}.get(what, 'pinner')}'s map "
                f"(group stamp {asked}): a copy it skipped is back or was replaced; refresh the map and {what} again")

    def _kv_still(self, pool: int, target: int, key: bytes, asked: int, stamp: int, *, grouped: bool = False) -> None:
        """After a put or delete ran: acknowledge it only if the daemon's map
        still places the key here with no later stamp (nor, ``grouped``, a
        later group stamp than the writer's) and the lease held throughout
        (the copy acted on would otherwise be one no reader looks for, or
        one beside a skipped copy that holds another value). The copy stays;
        the writer is told to try again."""
        gate = self.server.kv_gate
        assert gate is not None
        need = gate(pool, target, key, asked)
        group = self.server.kv_group
        if need is None or need > stamp or (grouped and group is not None and group(pool, key) > asked):
            self.counters["kv_moved_during"] += 1
            raise StaleVersionError(f"KV pool {pool}: the key's placement changed while the request ran on "
                                    f"target {target}; refresh the map and try again")
        ok = self.server.kv_lease_ok
        if ok is not None and not ok():
            self.counters["kv_lease_refusals"] += 1
            raise UnavailableError(f"target {target}: the node's KV map lease ran out while the request ran "
                                   "(meta unreachable?); try again")

    def _kv_served(self, pool: int, target: int, key: bytes, asked: int, since: int) -> bool:
        """After a get read its copy: serve it only if the map still wants
        no later copy here and the lease held."""
        gate = self.server.kv_gate
        assert gate is not None
        need = gate(pool, target, key, asked)
        if need is None or need > since:
            self.counters["kv_moved_during"] += 1
            return False
        return self._kv_leased(asked)

    def _reply(self, hdr: Header, *, payload: memoryview | None = None, store: _Releaser | None = None,
               length: int = 0, payload_crc: int | None = None, offset: int | None = None,
               chunk: int | None = None) -> None:
        if self.closed:
            if payload is not None and store is not None:
                store.release(payload)
            return
        n = 0 if payload is None else len(payload)
        if payload_crc is None:
            payload_crc = crc32c(payload) if payload is not None and n else 0
        head = bytearray(HEADER_SIZE)
        encode_header(head, hdr.op, hdr.request_id, flags=F_RESPONSE, target=hdr.target,
                      key=(hdr.inode, hdr.chunk if chunk is None else chunk, hdr.fragment, hdr.fversion),
                      offset=hdr.offset if offset is None else offset, length=length, payload_len=n,
                      payload_crc=payload_crc)
        if payload is None or n == 0:
            if payload is not None and store is not None:
                store.release(payload)
            self._send(head)
            return
        assert store is not None
        self.counters["bytes_sent"] += n
        self._inflight_bytes += n
        self._lent.append((store, payload, n))
        self._send(head, payload)

    def _send(self, *bufs: bytes | bytearray | memoryview) -> None:
        """Queue answer pieces; everything queued in one loop iteration goes
        out in one ``writelines`` (one writev), so answers that complete
        together (a batch, many small requests) share a syscall."""
        self._out.extend(bufs)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        out, self._out = self._out, []
        lent, self._lent = self._lent, []
        self._unsent.extend(lent)
        if not self.closed and out:
            self.transport.writelines(out)
        self._release_unsent(force=self.closed)

    def _reply_error(self, hdr: Header, exc: TierFSError) -> None:
        if self.closed:
            return
        msg = exc.message.encode("utf-8", "replace")[:_MAX_ERROR_MESSAGE]
        head = bytearray(HEADER_SIZE)
        encode_header(head, hdr.op, hdr.request_id, flags=F_RESPONSE, target=hdr.target,
                      status=int(exc.code), key=(hdr.inode, hdr.chunk, hdr.fragment, hdr.fversion), payload_len=len(msg), payload_crc=crc32c(msg))
        self._send(head, msg)

    def _release_unsent(self, force: bool = False) -> None:
        if not self._unsent:
            return
        if not force and self.transport is not None and self.transport.get_write_buffer_size():
            return
        freed = 0
        while self._unsent:
            store, view, n = self._unsent.popleft()
            store.release(view)
            freed += n
        self._inflight_bytes -= freed
        if not force:
            self._maybe_resume()


class _NotPooled:
    """Release target of answer payloads that belong to no store."""

    def release(self, buf: memoryview) -> None:
        pass


_NOT_POOLED: Any = _NotPooled()


class DataPlaneServer:
    """A running data-plane server. Build it with :func:`start_dataplane`."""

    def __init__(self, stores: Mapping[int, FragmentStore], limits: Limits,
                 kvstores: Mapping[int, KVTargetStore] | None = None) -> None:
        self.stores: dict[int, FragmentStore] = dict(stores)
        #: KV stores by target id (the daemon adds one per target).
        self.kvstores: dict[int, KVTargetStore] = dict(kvstores or {})
        #: Called (and awaited) before a KV request for a pool the store does
        #: not know: the daemon refreshes its pools from the cluster map.
        self.on_unknown_kv_pool: Callable[[int], Awaitable[None]] | None = None
        #: (pool, target, key, the stamp the client asked) -> the placement
        #: stamp to require of the target's copy, or None for a miss: the
        #: daemon's own map has its say too (tierfs.storage.daemon), so that
        #: a client whose map is older than a change is not served a copy
        #: the change left behind.
        self.kv_gate: Callable[[int, int, bytes, int], int | None] | None = None
        #: Whether the node holds a KV map lease now (docs/kv.md, "Map
        #: leases"), and a wait until a stamp may be taken (raises
        #: UnavailableError when it cannot be soon); None: not checked.
        self.kv_lease_ok: Callable[[], bool] | None = None
        #: (pool, key) -> the daemon's group stamp for the key: the latest
        #: placement stamp of any position in its group (0: not known).
        self.kv_group: Callable[[int, bytes], int] | None = None
        self.kv_settle: Callable[[int], Awaitable[None]] | None = None
        self.limits = limits
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        #: Whether every request needs a capability (the storage daemon's
        #: ``require_capabilities``); off, every KV key is tenant 0's.
        self.require_capabilities = False
        #: Capability keys by epoch, from meta (None: none yet).
        self.keyring: Keyring | None = None
        self.host = ""
        self.port = 0
        self.listeners: dict[str, Listener] = {}
        self._conns: set[_ServerConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def add_store(self, store: FragmentStore) -> None:
        self.stores[store.target_id] = store

    def remove_store(self, target_id: int) -> None:
        self.stores.pop(target_id, None)
        self.kvstores.pop(target_id, None)

    def add_kvstore(self, target_id: int, store: KVTargetStore) -> None:
        self.kvstores[target_id] = store

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _protocol(self) -> _ServerConnection:
        return _ServerConnection(self)

    async def close(self, grace: float = 5.0) -> None:
        """Stop listening, drop every connection, and give store operations
        already started ``grace`` seconds to finish before cancelling them."""
        for listener in self.listeners.values():
            await listener.close()
        self.listeners.clear()
        conns = list(self._conns)
        for conn in conns:
            conn.abort()
        tasks = list(self._tasks)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace)
            for t in late:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # Let the transports deliver connection_lost before the loop goes.
        await asyncio.sleep(0)

    async def __aenter__(self) -> DataPlaneServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_dataplane(
    stores: Mapping[int, FragmentStore],
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    limits: Limits | None = None,
    transports: Sequence[str] = ("tcp", "shm"),
    kvstores: Mapping[int, KVTargetStore] | None = None,
    tls: ssl.SSLContext | None = None,
) -> DataPlaneServer:
    """Start serving ``stores`` (and ``kvstores``) on ``host:port`` (TCP; 0
    picks a port) and on the other ``transports`` that are available here.
    ``tls``: the TCP port then speaks TLS only (tierfs.tls). Run it on uvloop."""
    server = DataPlaneServer(stores, limits or Limits(), kvstores)
    names = list(dict.fromkeys(["tcp", *transports]))
    try:
        for name in names:
            transport = get_transport(name, tls=tls)
            if not transport.available():
                log.info("dataplane transport %s not available here", name,
                         extra={"event": "dataplane.transport_unavailable", "transport": name})
                continue
            try:
                listener = await transport.listen(host, server.port or port, server._protocol,
                                                  limits=server.limits)
            except (OSError, TierFSError) as exc:
                if name == "tcp":
                    raise
                # An optional transport that cannot bind must not keep the
                # daemon from serving over tcp.
                log.warning("dataplane transport %s not started: %s", name, exc,
                            extra={"event": "dataplane.transport_failed", "transport": name,
                                   "reason": str(exc)})
                continue
            server.listeners[name] = listener
            if name == "tcp":
                server.host = host
                server.port = listener.port  # type: ignore[attr-defined]
    except BaseException:
        await server.close()
        raise
    log.info("dataplane listening on %s:%d (%s)", host, server.port, ", ".join(server.listeners),
             extra={"event": "dataplane.listening", "port": server.port, "transports": list(server.listeners)})
    return server


async def _amain(argv: Sequence[str] | None = None) -> None:
    import argparse
    import json
    import os
    import signal
    import sys

    from tierfs.net.memstore import MemoryFragmentStore

    ap = argparse.ArgumentParser(prog="python -m tierfs.storage.dataplane")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--memory-target", type=int, action="append", default=[])
    ap.add_argument("--disk-target", action="append", default=[], help="ID:PATH (needs the chunk engine)")
    ap.add_argument("--kv-target", action="append", default=[],
                    help="ID:PATH: a KV store (tierfs.storage.kvstore) on target ID, with the --kv-pool pools")
    ap.add_argument("--kv-pool", action="append", default=[], metavar="ID:MEMORY:DISK",
                    help="a KV pool of every --kv-target (bytes; default 1:67108864:0)")
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--no-verify", action="store_true",
                    help="memory targets skip their own CRC re-checks (network benchmarks)")
    ap.add_argument("--max-frame-bytes", type=int, default=Limits().max_frame_bytes)
    ap.add_argument("--cap-secret-file", default="",
                    help="require capabilities, with the keys of the current hour-long epoch (and its "
                         "neighbours) derived from this cluster secret (tests, benchmarks)")
    ap.add_argument("--tls-cert", default="", help="serve TLS on tcp with this PEM certificate (and --tls-key)")
    ap.add_argument("--tls-key", default="")
    ap.add_argument("--tls-ca", default="", help="verify client certificates against this CA")
    ap.add_argument("--tls-require-client-cert", action="store_true")
    args = ap.parse_args(argv)
    from tierfs.tls import TlsFiles

    tls = TlsFiles(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key,
                   require_client_cert=args.tls_require_client_cert) if args.tls_cert else None
    stores: dict[int, FragmentStore] = {
        t: MemoryFragmentStore(t, verify=not args.no_verify) for t in args.memory_target}
    closers: list[Any] = []
    if args.disk_target:
        from tierfs.buffers import BufferPool
        from tierfs.storage.engine import ChunkEngine
        from tierfs.storage.io import open_backend

        pool = BufferPool()
        backend = open_backend("auto", pool)
        for spec in args.disk_target:
            tid, _, path = spec.partition(":")
            engine = ChunkEngine(path, int(tid), backend, pool)
            await engine.open()
            stores[int(tid)] = engine
            closers.append(engine.close)
        closers.append(backend.aclose)
    kvstores: dict[int, Any] = {}
    if args.kv_target:
        from tierfs.buffers import BufferPool
        from tierfs.storage.kvstore import KVPoolSpec, KVStore

        kvpool = BufferPool()
        specs = []
        for spec in args.kv_pool or ["1:67108864:0"]:
            pid, mem, disk = (int(x) for x in spec.split(":"))
            specs.append(KVPoolSpec(pool_id=pid, name=f"pool{pid}", memory_bytes=mem, disk_bytes=disk))
        for spec in args.kv_target:
            tid, _, path = spec.partition(":")
            kv = KVStore(path, target_id=int(tid), pool=kvpool)
            await kv.open()
            kv.configure(specs)
            kvstores[int(tid)] = kv
            closers.append(kv.close)
    limits = Limits(max_frame_bytes=args.max_frame_bytes,
                    max_inflight_bytes=max(Limits().max_inflight_bytes, args.max_frame_bytes))
    server = await start_dataplane(stores, args.host, args.port, limits=limits,
                                   transports=args.transports.split(","), kvstores=kvstores,
                                   tls=tls.server_ssl_context() if tls is not None else None)
    if args.cap_secret_file:
        from tierfs.capability import Keyring, epoch_at, keys_around
        from tierfs.meta.secret import load_secret

        secret = load_secret(args.cap_secret_file)
        server.keyring = Keyring(keys_around(secret, epoch_at(int(time.time() * 1000), 3600.0)))
        server.require_capabilities = True
    print(json.dumps({"port": server.port, "transports": list(server.listeners)}), flush=True)
    loop = asyncio.get_running_loop()
    stop = loop.create_future()

    def _stop() -> None:
        if not stop.done():
            stop.set_result(None)

    loop.add_signal_handler(signal.SIGTERM, _stop)
    loop.add_signal_handler(signal.SIGINT, _stop)
    # stdin closing (the parent went away) also stops us.
    def _stdin() -> None:
        if not os.read(sys.stdin.fileno(), 4096):
            _stop()

    loop.add_reader(sys.stdin.fileno(), _stdin)
    await stop
    loop.remove_reader(sys.stdin.fileno())
    await server.close()
    for close in closers:
        await close()


def main(argv: Sequence[str] | None = None) -> None:
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(_amain(argv))


if __name__ == "__main__":
    main()
