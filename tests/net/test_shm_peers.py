"""The shm transport against hostile local peers (docs/dataplane.md, "shm and
local peers"): a data-plane server in its own process, and clients that
speak the handshake by hand.

* rings that are not sealed against resizing are refused at the handshake,
  so shrinking them afterwards (which made the server die of SIGBUS at its
  next access) cannot hurt it;
* sealed rings cannot be shrunk at all, and such a client works;
* a process of another user is refused by the server (``SO_PEERCRED``), and
  a client will not hand its rings to a socket held by another user.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pytest
from dataplane_helpers import arun, server_process

from tierfs.net import DataClient, MemoryFragmentStore
from tierfs.net.protocol import Limits
from tierfs.net.shm import _BELL, _HELLO, _REPLY, ShmRefusedError, socket_name
from tierfs.storage.api import FragmentKey
from tierfs.storage.dataplane import start_dataplane

SIZE = 1 << 16
NOBODY = 65534


def _rings(seals: int | None) -> list[int]:
    """Two memfd rings of SIZE bytes; sealed with ``seals`` unless None."""
    fds = []
    for _ in range(2):
        fd = os.memfd_create("hostile", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if seals is not None else 0))
        os.ftruncate(fd, SIZE)
        if seals:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        fds.append(fd)
    return fds


def _handshake(port: int, fds: list[int]) -> tuple[socket.socket, bool, str]:
    """Send the hello with ``fds``; (socket, accepted, reason) from the server's answer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(socket_name(port))
    # A server that refuses the peer at once may answer and hang up before
    # the hello: read why.
    with contextlib.suppress(BrokenPipeError):
        socket.send_fds(sock, [_HELLO.pack(b"TFSM", SIZE)], fds)
    head = b""
    while len(head) < _REPLY.size:
        chunk = sock.recv(_REPLY.size - len(head))
        assert chunk, "server hung up without answering the hello"
        head += chunk
    magic, ok, n = _REPLY.unpack(head)
    assert magic == b"TFSR"
    reason = b""
    while len(reason) < n:
        reason += sock.recv(n - len(reason))
    return sock, bool(ok), reason.decode()


async def _roundtrip(address: str, transport: str = "shm") -> None:
    key = FragmentKey(7, 0, 0, 1)
    async with DataClient(transport=transport, routes={1: address}) as c:
        await c.write(1, key, b"still serving")
        assert await c.read(1, key) == b"still serving"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seals", [None, 0, fcntl.F_SEAL_SHRINK, fcntl.F_SEAL_GROW], ids=[
    "no-sealing-allowed", "unsealed", "shrink-only", "grow-only"])
def test_ring_not_sealed_against_resizing_is_refused_and_shrinking_it_harms_nobody(
        seals: int | None, tmp_path: Path) -> None:
    with server_process("--memory-target", "1", log=tmp_path / "server.log") as srv:
        fds = _rings(seals)
        try:
            sock, ok, reason = _handshake(srv.port, fds)
            with sock:
                assert not ok and "not sealed against resizing" in reason, reason
                # What the old server died of: rings shrunk under its mapping,
                # then a doorbell that makes it read them.
                for fd in fds:
                    if not (seals or 0) & fcntl.F_SEAL_SHRINK:
                        os.ftruncate(fd, 0)
                try:
                    sock.sendall(_BELL.pack(b"W", 4096))
                    sock.recv(1)
                except OSError:
                    pass  # refused connections are closed
        finally:
            for fd in fds:
                os.close(fd)
        assert srv.proc.poll() is None, "the server died"
        arun(_roundtrip(srv.address))
        assert "not sealed against resizing" in (tmp_path / "server.log").read_text()


@pytest.mark.timeout(60)
def test_ring_that_is_not_a_memfd_is_refused(tmp_path: Path) -> None:
    with server_process("--memory-target", "1", log=tmp_path / "server.log") as srv:
        files = [os.open(tmp_path / f"ring{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(2)]
        try:
            for fd in files:
                os.ftruncate(fd, SIZE)
            sock, ok, reason = _handshake(srv.port, files)
            sock.close()
            assert not ok and "not a sealable memfd" in reason, reason
        finally:
            for fd in files:
                os.close(fd)
        assert srv.proc.poll() is None
        arun(_roundtrip(srv.address))


@pytest.mark.timeout(60)
def test_sealed_rings_work_and_cannot_be_shrunk(tmp_path: Path) -> None:
    with server_process("--memory-target", "1", log=tmp_path / "server.log") as srv:
        fds = _rings(fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        try:
            sock, ok, reason = _handshake(srv.port, fds)
            with sock:
                assert ok and not reason
                for fd in fds:
                    with pytest.raises(PermissionError):
                        os.ftruncate(fd, 0)
                    with pytest.raises(PermissionError):
                        os.ftruncate(fd, 2 * SIZE)
                # the accepted connection speaks doorbells: credit for nothing
                # sent is a protocol error that closes only this connection
                sock.sendall(_BELL.pack(b"C", 1))
                while sock.recv(4096):
                    pass
        finally:
            for fd in fds:
                os.close(fd)
        assert srv.proc.poll() is None
        arun(_roundtrip(srv.address))
    # The real client seals its rings the same way.
    async def client_seals() -> None:
        server = await start_dataplane({1: MemoryFragmentStore(1)}, transports=("tcp", "shm"))
        try:
            await _roundtrip(server.address)
        finally:
            await server.close()

    arun(client_seals())


class _Nobody:
    """``fn(out)`` run in a forked child as uid/gid NOBODY (no exec: the
    interpreter's files need not be readable by that user); what it writes
    to the file ``out`` comes back through :meth:`read`."""

    def __init__(self, fn: Callable[[BinaryIO], None]) -> None:
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.close(r)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                with os.fdopen(w, "wb", buffering=0) as out:
                    try:
                        fn(out)
                        code = 0
                    except BaseException as exc:
                        out.write(f"child failed: {exc!r}".encode())
            finally:
                os._exit(code)
        os.close(w)
        self.out = os.fdopen(r, "rb", buffering=0)

    def readline(self, timeout: float = 20.0) -> bytes:
        if not select.select([self.out], [], [], timeout)[0]:
            raise AssertionError("the child said nothing in time")
        return self.out.readline()

    def read(self, timeout: float = 20.0) -> bytes:
        data = b""
        deadline = time.monotonic() + timeout
        while chunk := self._read_some(max(0.0, deadline - time.monotonic())):
            data += chunk
        return data

    def _read_some(self, timeout: float) -> bytes:
        if not select.select([self.out], [], [], timeout)[0]:
            raise AssertionError("the child did not finish in time")
        return self.out.read(4096)

    def close(self, kill: bool = False) -> int:
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.out.close()
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_process_of_another_user_is_refused(tmp_path: Path) -> None:
    with server_process("--memory-target", "1", log=tmp_path / "server.log") as srv:
        def stranger(out: BinaryIO) -> None:
            # completes the hello with properly sealed rings
            fds = _rings(fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            sock, ok, reason = _handshake(srv.port, fds)
            sock.close()
            out.write(f"{ok} {reason}".encode())

        child = _Nobody(stranger)
        out = child.read().decode()
        assert child.close() == 0, out
        assert out.startswith("False ") and f"uid {NOBODY} may not use" in out, out
        assert srv.proc.poll() is None
        arun(_roundtrip(srv.address))
        assert f"shm connection from uid {NOBODY} refused" in (tmp_path / "server.log").read_text()


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_client_does_not_hand_rings_to_a_socket_held_by_another_user() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()

    def squat(out: BinaryIO) -> None:
        # Both names a server on 127.0.0.1:port binds: the port's and the address's.
        socks = []
        for name in (socket_name(port), socket_name(port, "127.0.0.1")):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(name)
            s.listen(8)
            socks.append(s)
        out.write(b"bound\n")
        conns = []
        while True:
            ready, _, _ = select.select(socks, [], [])
            for s in ready:
                c, _ = s.accept()
                conns.append(c)  # kept open: the client must refuse, not time out

    # Another user takes the abstract names before the server starts.
    squatter = _Nobody(squat)
    try:
        assert squatter.readline() == b"bound\n"

        async def body() -> None:
            server = await start_dataplane({1: MemoryFragmentStore(1)}, "127.0.0.1", port,
                                           transports=("tcp", "shm"))
            try:
                assert list(server.listeners) == ["tcp"]  # its shm names were taken
                async with DataClient(transport="shm", routes={1: server.address},
                                      limits=Limits(shm_ring_bytes=SIZE)) as c:
                    with pytest.raises(ShmRefusedError, match=f"held by uid {NOBODY}"):
                        await c.ping(1)
                # "auto" picks shm for a loopback peer; refused, it uses TCP
                await _roundtrip(server.address, transport="auto")
            finally:
                await server.close()

        arun(body())
    finally:
        squatter.close(kill=True)


@pytest.mark.timeout(60)
def test_daemons_on_two_addresses_with_one_port_are_each_reached_over_shm(tmp_path: Path) -> None:
    """Two data-plane servers on one host, on 127.0.0.1 and 127.0.0.2 with the
    same port (hosts simulated on loopback addresses, or one daemon per NIC):
    each is reached over shm at its own address. With the port's name alone
    the second started without shm, and a client's shm connection to it
    reached the first, which answered "target 2 is not served here"."""
    with server_process("--memory-target", "1", "--host", "127.0.0.1", log=tmp_path / "a.log") as a:
        routes = {1: f"127.0.0.1:{a.port}", 2: f"127.0.0.2:{a.port}"}

        async def body() -> None:
            async with DataClient(transport="shm", routes=routes, limits=Limits(shm_ring_bytes=SIZE)) as c:
                for target in (1, 2):
                    key = FragmentKey(7, 0, 0, target)
                    await c.write(target, key, b"target %d" % target)
                    assert await c.read(target, key) == b"target %d" % target

        with server_process("--memory-target", "2", "--host", "127.0.0.2", "--port", str(a.port),
                            log=tmp_path / "b.log") as b:
            assert b.port == a.port
            arun(body())
