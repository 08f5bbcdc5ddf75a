"""RDMA transport (pyverbs): RC queue pairs, RDMA WRITE into the peer's
registered ring.

It reuses the ring-stream design of :mod:`tierfs.net.shm`: each side registers
a receive ring (an ``MR`` with REMOTE_WRITE access) and a send staging ring;
the sender copies frames into its staging ring and posts a signalled
``IBV_WR_RDMA_WRITE`` to the same offset of the peer's ring, and after the
completion arrives rings the ``W`` doorbell; the receiver copies out of its
ring into the frame protocol's buffer and returns ``C`` credit. Doorbells,
credits and the connection setup (QP number, LID, GID, ring address and rkey)
travel over a TCP control connection to the server's data-plane port plus
:data:`CONTROL_PORT_OFFSET` (the data-plane port itself speaks frames).

Status: written against the pyverbs API but NEVER RUN — this machine has no
RDMA device and pyverbs is not installed. ``available()`` is False unless
pyverbs imports and lists a device; its tests are marked ``rdma`` and skip.
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

from tierfs.errors import UnavailableError, UnsupportedError
from tierfs.net.framing import FrameProtocol
from tierfs.net.protocol import Limits
from tierfs.net.shm import ShmStreamTransport, _Bells
from tierfs.net.transport import Listener, ProtocolFactory, Transport

__all__ = ["CONTROL_PORT_OFFSET", "RdmaTransport"]

#: rdma control connections go to the data-plane TCP port plus this.
CONTROL_PORT_OFFSET = 1000
_LEN = struct.Struct("<I")
_IB_PORT = 1
_GID_INDEX = 0


def _verbs() -> Any:
    try:
        import pyverbs.cq as cq  # type: ignore[import-not-found]
        import pyverbs.device as device  # type: ignore[import-not-found]
        import pyverbs.enums as enums  # type: ignore[import-not-found]
        import pyverbs.mr as mr  # type: ignore[import-not-found]
        import pyverbs.pd as pd  # type: ignore[import-not-found]
        import pyverbs.qp as qp  # type: ignore[import-not-found]
        import pyverbs.wr as wr  # type: ignore[import-not-found]
        from pyverbs.addr import GID, AHAttr, GlobalRoute  # type: ignore[import-not-found]
    except ImportError as exc:
        raise UnsupportedError(f"rdma transport needs pyverbs: {exc}") from None
    ns = dict(cq=cq, device=device, e=enums, mr=mr, pd=pd, qp=qp, wr=wr,
              GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute)
    return type("Verbs", (), ns)


class _Endpoint:
    """One side's verbs resources: PD, CQ, RC QP, send and receive rings."""

    def __init__(self, size: int) -> None:
        v = self.v = _verbs()
        devices = v.device.get_device_list()
        if not devices:
            raise UnavailableError("no RDMA device")
        self.ctx = v.device.Context(name=devices[0].name.decode())
        self.pd = v.pd.PD(self.ctx)
        access = (v.e.IBV_ACCESS_LOCAL_WRITE | v.e.IBV_ACCESS_REMOTE_WRITE
                  | v.e.IBV_ACCESS_REMOTE_READ)
        self.size = size
        self.rx = v.mr.MR(self.pd, size, access)
        self.tx = v.mr.MR(self.pd, size, v.e.IBV_ACCESS_LOCAL_WRITE)
        self.cq = v.cq.CQ(self.ctx, 256)
        cap = v.qp.QPCap(max_send_wr=256, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = v.qp.QPInitAttr(qp_type=v.e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        self.qp = v.qp.QP(self.pd, init)
        self.lid = self.ctx.query_port(_IB_PORT).lid
        self.gid = str(self.ctx.query_gid(_IB_PORT, _GID_INDEX))
        self.remote_addr = 0
        self.remote_rkey = 0

    def info(self) -> dict[str, Any]:
        return {"qpn": self.qp.qp_num, "lid": self.lid, "gid": self.gid,
                "addr": self.rx.buf, "rkey": self.rx.rkey, "size": self.size, "psn": 0}

    def connect(self, peer: dict[str, Any]) -> None:
        v = self.v
        if peer["size"] != self.size:
            raise UnavailableError("rdma ring sizes differ")
        self.remote_addr, self.remote_rkey = int(peer["addr"]), int(peer["rkey"])
        attr = v.qp.QPAttr(port_num=_IB_PORT)
        attr.qp_access_flags = v.e.IBV_ACCESS_REMOTE_WRITE | v.e.IBV_ACCESS_LOCAL_WRITE
        self.qp.to_init(attr)
        gr = v.GlobalRoute(dgid=v.GID(peer["gid"]), sgid_index=_GID_INDEX)
        attr.ah_attr = v.AHAttr(gr=gr, is_global=1, port_num=_IB_PORT, dlid=peer["lid"])
        attr.dest_qp_num = peer["qpn"]
        attr.path_mtu = v.e.IBV_MTU_1024
        attr.rq_psn = peer["psn"]
        attr.sq_psn = 0
        self.qp.to_rtr(attr)
        self.qp.to_rts(attr)

    def write_remote(self, pos: int, data: memoryview) -> None:
        v = self.v
        n = len(data)
        self.tx.write(bytes(data), n, pos)
        sge = v.wr.SGE(self.tx.buf + pos, n, self.tx.lkey)
        wr = v.wr.SendWR(opcode=v.e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge],
                         send_flags=v.e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(self.remote_rkey, self.remote_addr + pos)
        self.qp.post_send(wr)
        # The doorbell may only go out once the bytes are in the peer's ring.
        while True:
            count, wcs = self.cq.poll()
            if count:
                if wcs[0].status != v.e.IBV_WC_SUCCESS:
                    raise UnavailableError(f"RDMA WRITE failed with status {wcs[0].status}")
                return

    def read_local(self, pos: int, n: int) -> bytes:
        return bytes(self.rx.read(n, pos))

    def close(self) -> None:
        for res in (self.qp, self.cq, self.tx, self.rx, self.pd, self.ctx):
            res.close()


class _RdmaStreamTransport(ShmStreamTransport):
    _offload_copies = False  # _copy_out reads the memory region through the verbs library

    def __init__(self, ep: _Endpoint, protocol: FrameProtocol, peer: str) -> None:
        super().__init__(None, None, protocol, peer, size=ep.size)
        self.ep = ep

    def _copy_in(self, pos: int, data: memoryview) -> None:
        self.ep.write_remote(pos, data)

    def _copy_out(self, buf: memoryview, pos: int, n: int) -> None:
        buf[:n] = self.ep.read_local(pos, n)

    def _unmap(self) -> None:
        self.ep.close()


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    mine: dict[str, Any]) -> dict[str, Any]:
    body = json.dumps(mine).encode()
    writer.write(_LEN.pack(len(body)) + body)
    await writer.drain()
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > 4096:
        raise UnavailableError("rdma hello too large")
    peer: dict[str, Any] = json.loads(await reader.readexactly(n))
    return peer


async def _attach(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ep: _Endpoint,
                  protocol: FrameProtocol, peer: str) -> None:
    transport = _RdmaStreamTransport(ep, protocol, peer)
    bells = _Bells(transport)
    sock_transport: Any = writer.transport
    protocol.connection_made(transport)
    # Take the control socket over from the stream helpers for doorbells.
    sock_transport.set_protocol(bells)
    bells.connection_made(sock_transport)


class _RdmaListener(Listener):
    def __init__(self, server: asyncio.Server, port: int) -> None:
        self.server = server
        self.address = f"rdma-control:{port}"

    async def close(self) -> None:
        self.server.close()
        await self.server.wait_closed()


class RdmaTransport(Transport):
    name = "rdma"

    @classmethod
    def available(cls) -> bool:
        try:
            v = _verbs()
            return bool(v.device.get_device_list())
        except Exception:
            return False

    async def connect(
        self, host: str, port: int, factory: ProtocolFactory, *, limits: Limits, timeout: float
    ) -> FrameProtocol:
        # The verbs resources first: a host without pyverbs or an RDMA device
        # says so (UnsupportedError, not retried) before any socket is open.
        try:
            ep = _Endpoint(limits.shm_ring_bytes)
        except UnavailableError as exc:
            raise UnsupportedError(f"rdma transport: {exc}") from None
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port + CONTROL_PORT_OFFSET)
                ep.connect(await _exchange(reader, writer, ep.info()))
        except BaseException as exc:
            # Whatever ends the handshake (a refusal, a peer that is not an
            # rdma control port, a cancel) closes the control connection.
            if writer is not None:
                writer.close()
            if isinstance(exc, (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError)):
                raise UnavailableError(f"cannot connect to {host}:{port} over rdma: {exc or 'timeout'}") from None
            raise
        protocol = factory()
        await _attach(reader, writer, ep, protocol, f"rdma:{host}:{port}")
        return protocol

    async def listen(self, host: str, port: int, factory: ProtocolFactory, *, limits: Limits) -> Listener:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            ep = _Endpoint(limits.shm_ring_bytes)
            ep.connect(await _exchange(reader, writer, ep.info()))
            await _attach(reader, writer, ep, factory(), "rdma-client")

        server = await asyncio.start_server(accept, host, port + CONTROL_PORT_OFFSET)
        return _RdmaListener(server, port + CONTROL_PORT_OFFSET)
