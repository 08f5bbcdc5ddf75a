"""Helpers for the data-plane tests: a uvloop runner, the transports that run
here, stores with injectable faults, and a data-plane server in a separate
process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvloop

from tierfs.net.memstore import MemoryFragmentStore
from tierfs.net.rdma import RdmaTransport
from tierfs.storage.api import FragmentInfo, FragmentKey

T = TypeVar("T")

TRANSPORTS = [
    "tcp",
    "shm",
    pytest.param("rdma", marks=[
        pytest.mark.rdma,
        pytest.mark.skipif(not RdmaTransport.available(), reason="no RDMA device / pyverbs here"),
    ]),
]

#: Each transport runs with answers checked on the loop ("") and with every
#: answer of 64 KiB or more checked, and (shm) copied, on worker threads
#: ("+offload"; tierfs.net.framing, "Off the loop"): the default on 8 CPUs or more.
OFFLOAD = {"": "0", "+offload": str(64 << 10)}


def transport_params(transports: list[Any]) -> list[Any]:
    """(transport, offload) parameters: each of ``transports`` both ways."""
    out = []
    for t in transports:
        name, marks = (t.values[0], t.marks) if hasattr(t, "values") else (t, ())
        out += [pytest.param((name, o), marks=marks, id=f"{name}{o}") for o in OFFLOAD]
    return out


def use_transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The transport of a ``transport_params`` parameter, its offload set
    (TIERFS_OFFLOAD_MIN_BYTES, read when a client's Limits are made)."""
    name, offload = request.param
    monkeypatch.setenv("TIERFS_OFFLOAD_MIN_BYTES", OFFLOAD[offload])
    return str(name)


def arun(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on a fresh uvloop loop (what the daemons run on)."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


class FaultyStore(MemoryFragmentStore):
    """A memory store whose operations can be made to block or blow up."""

    def __init__(self, target_id: int, capacity: int = 1 << 40) -> None:
        super().__init__(target_id, capacity)
        self.gate: asyncio.Event | None = None
        self.boom: Exception | None = None
        self.active = 0
        self.max_active = 0

    async def _enter(self) -> None:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.boom is not None:
                raise self.boom
        finally:
            self.active -= 1

    async def write(self, key: FragmentKey, data: memoryview, crc32c_: int) -> None:
        await self._enter()
        await super().write(key, data, crc32c_)

    async def read(self, key: FragmentKey, offset: int = 0, length: int = -1) -> memoryview:
        await self._enter()
        return await super().read(key, offset, length)

    async def stat(self, key: FragmentKey) -> FragmentInfo:
        await self._enter()
        return await super().stat(key)


async def wait_for(cond: Any, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class ServerProcess:
    def __init__(self, proc: subprocess.Popen[bytes], port: int) -> None:
        self.proc = proc
        self.port = port
        self.address = f"127.0.0.1:{port}"


@contextlib.contextmanager
def server_process(*args: str, log: Path, timeout: float = 30.0) -> Iterator[ServerProcess]:
    """A data-plane server (``python -m tierfs.storage.dataplane``) in its own
    process, its stderr in ``log``; stops when its stdin closes."""
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierfs.storage.dataplane", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout):
                raise AssertionError("data-plane server did not report its port in time")
        finally:
            sel.close()
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=15)
            raise AssertionError(f"data-plane server failed to start: {log.read_text(errors='replace')}")
        yield ServerProcess(proc, int(json.loads(line)["port"]))
    finally:
        if proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.asynccontextmanager
async def disk_store(root: Path, target_id: int) -> AsyncIterator[Any]:
    """The chunk engine on ``root`` (posix backend), as the daemon builds it."""
    from tierfs.buffers import BufferPool
    from tierfs.storage.engine import ChunkEngine
    from tierfs.storage.io import open_backend

    pool = BufferPool(256 << 20)
    backend = open_backend("posix", pool)
    engine = ChunkEngine(root, target_id, backend, pool)
    await engine.open()
    try:
        yield engine
    finally:
        await engine.close()
        await backend.aclose()
        pool.close()
