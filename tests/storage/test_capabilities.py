"""Data-plane capabilities against real daemons (docs/security-caps.md).

One local cluster (1 meta replica, 2 storage daemons) for the module, meta
rotating capability keys every few seconds. Every data-plane op is sent in
frames this test builds itself (tierfs.net.protocol.encode_header over a
plain socket), with no capability and with each kind of bad one; each case
ends by checking that nothing changed (an authorised read) and that the
daemons' refusal counters (Prometheus) rose."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import wait_for
from tierfs import capability as capmod
from tierfs.client import AsyncClient
from tierfs.errors import ErrorCode
from tierfs.local import LocalCluster
from tierfs.meta.secret import load_secret
from tierfs.net.protocol import (
    HEADER_SIZE,
    Header,
    Op,
    crc32c,
    decode_header,
    encode_header,
    pack_keys,
)

pytestmark = pytest.mark.timeout(120)

ROTATION = 3.0  # seconds per key epoch (meta's --cap-key-rotation)
UNAUTH = int(ErrorCode.ERROR_CODE_UNAUTHENTICATED)
EXPIRED = int(ErrorCode.ERROR_CODE_CAPABILITY_EXPIRED)
DENIED = int(ErrorCode.ERROR_CODE_PERMISSION_DENIED)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cl = LocalCluster(tmp_path_factory.mktemp("caps"), n_meta=1, n_storage=2,
                      extra_meta_args=[f"--cap-key-rotation={ROTATION}", f"--file-cap-ttl={ROTATION}",
                                       f"--kv-cap-ttl={ROTATION}"],
                      extra_storage_args=["--metrics-addr=127.0.0.1:0", "--heartbeat-interval=0.3"])
    cl.up(timeout=90)
    yield cl
    cl.stop()


def _ready(cl: LocalCluster, name: str) -> dict[str, object]:
    lines = (cl.dir / "logs" / f"{name}.out").read_text().splitlines()
    docs = [json.loads(x) for x in lines if x.startswith("{")]
    return [d for d in docs if d.get("event") == "ready"][-1]


def _refusals(cl: LocalCluster) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in ("storage-0", "storage-1"):
        text = urllib.request.urlopen(f"http://{_ready(cl, name)['metrics']}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith("tierfs_dataplane_cap_refusals_total{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _secret(cl: LocalCluster) -> bytes:
    return load_secret(cl.secret_file)


def _epoch() -> int:
    return capmod.epoch_at(int(time.time() * 1000), ROTATION)


def _cap(secret: bytes, *, kind: int = capmod.KIND_FILE, ops: int = capmod.OP_READ, scope: int,
         principal: int = 0, ttl_ms: int = 2500, epoch: int | None = None) -> bytes:
    e = _epoch() if epoch is None else epoch
    return capmod.encode(capmod.mint(capmod.epoch_key(secret, e), kind=kind, ops=ops, epoch=e, scope=scope,
                                     principal=principal, expiry_ms=int(time.time() * 1000) + ttl_ms))


def _forged(raw: bytes) -> bytes:
    b = bytearray(raw)
    b[-1] ^= 0x5A
    return bytes(b)


class Raw:
    """One data-plane connection driven frame by frame."""

    def __init__(self, addr: str) -> None:
        host, _, port = addr.rpartition(":")
        self.s = socket.create_connection((host, int(port)), timeout=10)
        self.rid = 0

    def close(self) -> None:
        self.s.close()

    def _recvn(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            got = self.s.recv(n - len(buf))
            if not got:
                raise ConnectionError("data-plane connection closed by the server")
            buf += got
        return bytes(buf)

    def call(self, op: int, target: int, *, key: tuple[int, int, int, int] = (0, 0, 0, 0), slot: int = 0,
             offset: int = 0, length: int = 0, payload: bytes = b"", crc: int | None = None) -> tuple[Header, bytes]:
        self.rid += 1
        head = bytearray(HEADER_SIZE)
        encode_header(head, op, self.rid, target=target, status=slot, key=key, offset=offset, length=length,
                      payload_len=len(payload), payload_crc=crc32c(payload) if crc is None else crc)
        self.s.sendall(bytes(head) + payload)
        hdr = decode_header(self._recvn(HEADER_SIZE), 1 << 30)
        assert hdr.request_id == self.rid
        return hdr, self._recvn(hdr.payload_len)

    def cap(self, slot: int, raw: bytes) -> int:
        hdr, msg = self.call(Op.CAP, 0, slot=slot, payload=raw)
        self.last = msg.decode()
        return hdr.status

    # fragment ops
    def read(self, target: int, key: tuple[int, int, int, int], slot: int) -> tuple[Header, bytes]:
        return self.call(Op.READ, target, key=key, slot=slot, length=(1 << 64) - 1)

    # KV ops (inode = pool id)
    def kv(self, op: int, target: int, pool: int, key: bytes, slot: int, value: bytes = b"",
           pin: int = 1) -> tuple[Header, bytes]:
        if op == Op.KV_PUT:
            v = crc32c(value)
            return self.call(op, target, key=(pool, 0, 0, v), slot=slot, offset=len(key), payload=value + key,
                             crc=crc32c(key, v))
        if op == Op.KV_EXISTS:
            return self.call(op, target, key=(pool, 0, 0, 0), slot=slot, offset=1, payload=pack_keys([key]))
        if op == Op.KV_PIN:
            return self.call(op, target, key=(pool, 0, pin, 0), slot=slot, payload=key)
        return self.call(op, target, key=(pool, 0, 0, 0), slot=slot, length=1 << 20, payload=key)


async def _setup_files(cl: LocalCluster) -> dict[str, object]:
    async with AsyncClient(cl.meta_addrs, request_timeout=10.0) as c:
        await c.mkdir("/caps")
        await c.set_layout("/caps", chunk_size=1 << 16, redundancy="replica:2")
        await c.write_bytes("/caps/a", b"A" * 70000)
        await c.write_bytes("/caps/b", b"B" * 1000)
        ia = await c.meta.stat("/caps/a")
        ib = await c.meta.stat("/caps/b")
        cmap = await c.meta.get_cluster_map()
        assert ia.capability, "meta mints a read capability into FileInfo"
        pool_a = await c.meta.create_kv_pool("caps-a", target_memory=1 << 20)
        pool_b = await c.meta.create_kv_pool("caps-b", target_memory=1 << 20, tenant="group")
        assert pool_b.tenant == "group"
    groups = {g.group_id: list(g.target_ids) for g in cmap.groups}
    node_addr = {n.node_id: n.data_addr for n in cmap.nodes}
    t_addr = {t.target_id: node_addr[t.node_id] for t in cmap.targets}
    members = groups[ia.layout.groups[0]]
    frags = [(members[i], t_addr[members[i]], (ia.attr.inode, 0, i, ia.chunks[0].generation))
             for i in range(len(members))]
    return {"a": ia.attr.inode, "b": ib.attr.inode, "frags": frags, "pool_a": pool_a.pool_id,
            "pool_b": pool_b.pool_id, "targets": t_addr}


@pytest.fixture(scope="module")
def world(cluster: LocalCluster) -> dict[str, object]:
    return asyncio.run(_setup_files(cluster))


def _grew(before: dict[str, float], after: dict[str, float], reason: str, n: int) -> None:
    assert after.get(reason, 0) - before.get(reason, 0) >= n, (reason, before, after)


def test_client_round_trip_under_capabilities(cluster: LocalCluster, world: dict[str, object]) -> None:
    async def go() -> None:
        async with AsyncClient(cluster.meta_addrs, request_timeout=10.0) as c:
            await c.write_bytes("/caps/c", b"C" * 5000)
            assert await c.read_bytes("/caps/c") == b"C" * 5000
        async with AsyncClient(cluster.meta_addrs, request_timeout=10.0) as c:
            f = await c.open("/caps/a", "rb")  # stats once: its read capability comes with it
            before = _refusals(cluster)
            # past the capability's life (ROTATION s): the daemons answer
            # CapabilityExpired, the client fetches a fresh one and retries once
            await asyncio.sleep(ROTATION + 0.5)
            assert await f.read() == b"A" * 70000
            await f.close()
            _grew(before, _refusals(cluster), "expired", 1)
            kv = c.kv_pool("caps-a")
            await kv.put("k1", b"v1")
            assert await kv.get("k1") == b"v1"
            assert c._data is not None and len(c._data.caps) >= 2
    asyncio.run(go())


FILE_READS = (Op.READ, Op.STAT)
FILE_WRITES = (Op.WRITE, Op.DELETE)


def _file_op(raw: Raw, op: int, target: int, key: tuple[int, int, int, int], slot: int) -> Header:
    if op == Op.READ:
        return raw.read(target, key, slot)[0]
    if op == Op.WRITE:
        return raw.call(op, target, key=key, slot=slot, payload=b"evil" * 4096)[0]
    return raw.call(op, target, key=key, slot=slot)[0]


def test_fragment_ops_refused_without_a_valid_capability(cluster: LocalCluster, world: dict[str, object]) -> None:
    secret = _secret(cluster)
    frags = world["frags"]
    assert isinstance(frags, list)
    a, b = world["a"], world["b"]
    assert isinstance(a, int) and isinstance(b, int)
    before = _refusals(cluster)
    for target, addr, key in frags:
        raw = Raw(addr)
        try:
            good = _cap(secret, scope=a)
            assert raw.cap(1, good) == 0, raw.last
            ref, want = raw.read(target, key, 1)
            assert ref.status == 0 and len(want) > 0
            assert raw.cap(2, _forged(good)) == UNAUTH
            assert raw.cap(3, _cap(secret, scope=a, ttl_ms=-1000)) == EXPIRED
            assert raw.cap(4, _cap(secret, scope=b, ops=capmod.OP_READ | capmod.OP_WRITE)) == 0
            # A retired key: daemons hold e-1..e+1 of the keys meta last sent
            # them, which under load may be an epoch (3 s here) or two behind
            # this clock; e-4 is retired whatever that lag.
            assert raw.cap(5, _cap(secret, scope=a, epoch=_epoch() - 4)) == EXPIRED
            cases = [(0, UNAUTH), (77, UNAUTH), (2, UNAUTH), (3, EXPIRED), (4, DENIED), (5, EXPIRED)]
            for op in (*FILE_READS, *FILE_WRITES):
                for slot, code in cases + ([(1, DENIED)] if op in FILE_WRITES else []):  # read cap used to write
                    hdr = _file_op(raw, op, target, key, slot)
                    assert hdr.status == code, (Op(op).name, slot, hdr.status)
            # a refused WRITE of a fragment that did not exist stored nothing
            fresh = (key[0], 9, key[2], key[3])
            for slot in (0, 2, 3, 4, 1):
                assert _file_op(raw, Op.WRITE, target, fresh, slot).status != 0
            assert raw.call(Op.STAT, target, key=fresh, slot=1)[0].status == int(ErrorCode.ERROR_CODE_NOT_FOUND)
            # the connection still works (refused payloads were drained), nothing changed
            again, got = raw.read(target, key, 1)
            assert again.status == 0 and got == want
        finally:
            raw.close()
    after = _refusals(cluster)
    n = len(frags)
    _grew(before, after, "missing", 2 * 4 * n)
    _grew(before, after, "forged", 4 * n)
    _grew(before, after, "expired", 2 * 4 * n)
    _grew(before, after, "scope", 4 * n)
    _grew(before, after, "op", 2 * n)

    async def whole() -> bytes:
        async with AsyncClient(cluster.meta_addrs, request_timeout=10.0) as c:
            return await c.read_bytes("/caps/a")
    assert asyncio.run(whole()) == b"A" * 70000


def test_a_write_capability_covers_its_own_session_only(cluster: LocalCluster, world: dict[str, object]) -> None:
    """A write session's capability, after the session was aborted, against
    the file's committed fragments: until stop 48 it overwrote and deleted
    them (for file_cap_ttl, whatever chmod did meanwhile), and the file read
    back CorruptError, then GenerationGone. Now it covers the generations of
    its own session only; it lives for the session's lease and a minute."""
    from tierfs.chunk import generation
    from tierfs.meta.client import MetaClient

    frags = world["frags"]
    a = world["a"]
    assert isinstance(frags, list) and isinstance(a, int)

    async def session() -> tuple[bytes, int]:
        async with MetaClient(cluster.meta_addrs) as mc:
            ow = await mc.open_write("/caps/a")
            await mc.abort_write(ow.session_id)
            return ow.write_capability, ow.data_version

    wcap, version = asyncio.run(session())
    c = capmod.decode(wcap)
    assert c.session == version and c.principal & 0xFFFFFFFF == 0 and c.ops == capmod.OP_WRITE
    assert c.expiry_ms - time.time() * 1000 <= ROTATION * 1000  # file_cap_ttl is 3 s here, below lease + 60 s
    before = _refusals(cluster)
    for target, addr, key in frags:
        raw = Raw(addr)
        try:
            assert raw.cap(1, wcap) == 0, raw.last
            assert raw.cap(2, _cap(_secret(cluster), scope=a)) == 0, raw.last
            _, want = raw.read(target, key, 2)
            for op in FILE_WRITES:
                hdr = _file_op(raw, op, target, key, 1)
                assert hdr.status == DENIED, (Op(op).name, hdr.status)
            again, got = raw.read(target, key, 2)
            assert again.status == 0 and got == want
            own = (a, 7, key[2], generation(version, 0))  # a fragment of its own session: allowed
            assert _file_op(raw, Op.WRITE, target, own, 1).status == 0
            assert _file_op(raw, Op.DELETE, target, own, 1).status == 0
        finally:
            raw.close()
    _grew(before, _refusals(cluster), "scope", 2 * len(frags))

    async def whole() -> bytes:
        async with AsyncClient(cluster.meta_addrs, request_timeout=10.0) as c:
            return await c.read_bytes("/caps/a")
    assert asyncio.run(whole()) == b"A" * 70000


KV_READS = (Op.KV_GET, Op.KV_EXISTS)
KV_WRITES = (Op.KV_PUT, Op.KV_DELETE, Op.KV_PIN)


def test_kv_ops_refused_without_a_valid_capability(cluster: LocalCluster, world: dict[str, object]) -> None:
    secret = _secret(cluster)
    pa, pb_ = world["pool_a"], world["pool_b"]
    targets = world["targets"]
    assert isinstance(pa, int) and isinstance(pb_, int) and isinstance(targets, dict)
    target, addr = sorted(targets.items())[0]
    before = _refusals(cluster)
    raw = Raw(addr)
    try:
        rw = _cap(secret, kind=capmod.KIND_KV, ops=capmod.OP_READ | capmod.OP_WRITE, scope=pa, principal=7)
        ro = _cap(secret, kind=capmod.KIND_KV, ops=capmod.OP_READ, scope=pa, principal=7)
        assert raw.cap(1, rw) == 0 and raw.cap(2, ro) == 0
        assert raw.kv(Op.KV_PUT, target, pa, b"key", 1, value=b"value")[0].status == 0
        assert raw.cap(3, _forged(rw)) == UNAUTH
        assert raw.cap(4, _cap(secret, kind=capmod.KIND_KV, ops=3, scope=pa, principal=7, ttl_ms=-1)) == EXPIRED
        assert raw.cap(5, _cap(secret, kind=capmod.KIND_KV, ops=3, scope=pb_, principal=7)) == 0  # another pool's
        assert raw.cap(6, _cap(secret, ops=3, scope=pa)) == 0  # a file capability whose inode is the pool id
        cases = [(0, UNAUTH), (99, UNAUTH), (3, UNAUTH), (4, EXPIRED), (5, DENIED), (6, DENIED)]
        for op in (*KV_READS, *KV_WRITES):
            for slot, code in cases + ([(2, DENIED)] if op in KV_WRITES else []):
                hdr, _ = raw.kv(op, target, pa, b"key", slot, value=b"EVIL")
                assert hdr.status == code, (Op(op).name, slot, hdr.status)
        hdr, got = raw.kv(Op.KV_GET, target, pa, b"key", 2)
        assert hdr.status == 0 and hdr.length == 1 and got == b"value"
        for slot in (0, 3, 4, 5, 6, 2):  # a refused put of a new key stores nothing
            assert raw.kv(Op.KV_PUT, target, pa, b"fresh", slot, value=b"EVIL")[0].status != 0
        assert raw.kv(Op.KV_GET, target, pa, b"fresh", 1)[0].length == 0
        # not pinned by the refused KV_PINs: an unpin finds it but that is all we can see;
        # a refused delete left it, a refused put did not overwrite it (checked above)
    finally:
        raw.close()
    after = _refusals(cluster)
    _grew(before, after, "missing", 2 * 5)
    _grew(before, after, "forged", 5)
    _grew(before, after, "expired", 5)
    _grew(before, after, "scope", 2 * 5)
    _grew(before, after, "op", 3)


@pytest.mark.parametrize("pool_key", ["pool_a", "pool_b"])
def test_kv_tenants_cannot_see_each_other(cluster: LocalCluster, world: dict[str, object], pool_key: str) -> None:
    secret = _secret(cluster)
    pool = world[pool_key]
    targets = world["targets"]
    assert isinstance(pool, int) and isinstance(targets, dict)
    target, addr = sorted(targets.items())[-1]
    # tenants as meta mints them: uids (a "user" pool) or GROUP_TENANT | gid (a "group" pool)
    mode = "group" if pool_key == "pool_b" else "user"
    x, y = capmod.tenant_of(1000, 100, mode), capmod.tenant_of(2000, 200, mode)
    raw = Raw(addr)
    try:
        assert raw.cap(1, _cap(secret, kind=capmod.KIND_KV, ops=3, scope=pool, principal=x)) == 0
        assert raw.cap(2, _cap(secret, kind=capmod.KIND_KV, ops=3, scope=pool, principal=y)) == 0
        assert raw.kv(Op.KV_PUT, target, pool, b"secret", 1, value=b"of-x")[0].length == 1
        get_y = raw.kv(Op.KV_GET, target, pool, b"secret", 2)[0]
        assert get_y.status == 0 and get_y.length == 0  # a miss: Y's namespace has no such key
        _, bits = raw.kv(Op.KV_EXISTS, target, pool, b"secret", 2)
        assert bits == b"\x00"
        assert raw.kv(Op.KV_PIN, target, pool, b"secret", 2)[0].length == 0
        assert raw.kv(Op.KV_DELETE, target, pool, b"secret", 2)[0].length == 0
        assert raw.kv(Op.KV_PUT, target, pool, b"secret", 2, value=b"of-y")[0].length == 1  # Y's own, new
        hdr, got = raw.kv(Op.KV_GET, target, pool, b"secret", 1)
        assert hdr.length == 1 and got == b"of-x"
        _, got = raw.kv(Op.KV_GET, target, pool, b"secret", 2)
        assert got == b"of-y"
    finally:
        raw.close()


def test_key_rotation_reaches_daemons(cluster: LocalCluster, world: dict[str, object]) -> None:
    secret = _secret(cluster)
    frags = world["frags"]
    a = world["a"]
    assert isinstance(frags, list) and isinstance(a, int)
    target, addr, key = frags[0]
    e0 = _epoch()
    # far from its own expiry however slowly a loaded machine runs the waits below
    old = _cap(secret, scope=a, epoch=e0, ttl_ms=300_000)
    # keys of an epoch two ahead are not handed out yet
    raw = Raw(addr)
    try:
        assert raw.cap(1, _cap(secret, scope=a, epoch=e0 + 2)) == UNAUTH
        assert raw.cap(2, old) == 0
        wait_for(lambda: _epoch() >= e0 + 2 or None, 3 * ROTATION, "two key epochs to pass")

        def new_key_known() -> bool | None:
            return raw.cap(3, _cap(secret, scope=a, ttl_ms=60_000)) == 0 or None

        wait_for(new_key_known, 30, "the daemon to learn the new epoch's key from a heartbeat", interval=0.2)
        assert raw.read(target, key, 3)[0].status == 0
        # once the daemon's keys are e0+1..e0+3, e0 is retired: its capability
        # (far from its own expiry) is refused as expired
        wait_for(lambda: raw.cap(4, old) == EXPIRED or None, 30, "epoch e0 to be retired", interval=0.2)
        assert raw.read(target, key, 4)[0].status == EXPIRED
        assert raw.read(target, key, 2)[0].status == 0  # verified once, when it came: good until its expiry
    finally:
        raw.close()


def test_meta_mints_by_permission_and_tenant(tmp_path: Path) -> None:
    """Minting decisions for other identities (until authn stamps real
    callers): a read capability only for a caller that may read; KV tenants
    by uid, or by gid for a "group" pool."""
    from tests.meta.meta_helpers import meta_server
    from tierfs.proto.v1 import meta_pb2 as pb
    from tierfs.security import Identity, current_identity

    secret = b"k" * 32
    alice = Identity("alice", 1000, 100, (), False, "user")
    bob = Identity("bob", 2000, 200, (), False, "user")

    async def go() -> None:
        async with meta_server(cluster_secret=secret) as (mc, svc, _):
            await mc.register_node("n0", "h", "127.0.0.1:1", [("/t", 1 << 40)])
            await mc.create_kv_pool("u", target_memory=1 << 20)
            await mc.create_kv_pool("g", target_memory=1 << 20, tenant="group")
            # A real file (the check includes search permission along its path).
            made = await mc.create("/alices", 0o600, 1000, 100, redundancy="replica:1")
            info = pb.FileInfo(attr=made.attr)
            tok = current_identity.set(alice)
            try:
                got = svc._with_read_cap(pb.FileInfo(attr=info.attr))
                c = capmod.decode(got.capability)
                assert (c.kind, c.scope, c.ops, c.principal) == (capmod.KIND_FILE, made.attr.inode, capmod.OP_READ, 1000)
                assert capmod.decode(svc.kv_capability("u").capability).principal == 1000
                assert capmod.decode(svc.kv_capability("g").capability).principal == capmod.GROUP_TENANT | 100
            finally:
                current_identity.reset(tok)
            tok = current_identity.set(bob)
            try:
                assert not svc._with_read_cap(pb.FileInfo(attr=info.attr)).capability  # 0600, not his
                assert capmod.decode(svc.kv_capability("u").capability).principal == 2000
            finally:
                current_identity.reset(tok)
            keys = svc.cap_keys()
            assert len(keys) == 3 and keys[1].key == capmod.epoch_key(secret, keys[1].epoch)
            with pytest.raises(Exception, match="tenant"):
                await mc.create_kv_pool("bad", target_memory=1 << 20, tenant="world")
    asyncio.run(go())


def test_capabilities_apply_over_shm(cluster: LocalCluster, world: dict[str, object]) -> None:
    """shm is offered to this test (same uid as the daemons); it still needs capabilities."""
    from tierfs.errors import UnauthenticatedError
    from tierfs.net import DataClient
    from tierfs.storage.api import FragmentKey

    frags = world["frags"]
    assert isinstance(frags, list)
    target, addr, key = frags[0]

    async def go() -> None:
        async with DataClient(transport="shm", routes={target: addr}) as dc:
            with pytest.raises(UnauthenticatedError, match="needs a capability"):
                await dc.read(target, FragmentKey(*key))
            async with AsyncClient(cluster.meta_addrs) as c:
                info = await c.meta.stat("/caps/a")
            dc.caps.add(info.capability)
            assert len(await dc.read(target, FragmentKey(*key))) > 0
    asyncio.run(go())
