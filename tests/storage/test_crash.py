"""SIGKILL a real process mid-stream of fragment writes; nothing acknowledged is
lost and nothing half-written is ever visible."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.storage.crash_writer import payload
from tierfs.buffers import BufferPool
from tierfs.storage.api import FragmentKey
from tierfs.storage.engine import ChunkEngine
from tierfs.storage.io import IOBackend

WRITER = Path(__file__).with_name("crash_writer.py")
REPO = Path(__file__).resolve().parents[2]


def _key(seed: int) -> FragmentKey:
    return FragmentKey(seed, seed % 7, seed % 3, 1)


def _write_until_killed(root: Path, kind: str, first: int, acks_wanted: int) -> set[int]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(root), kind, str(first)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    )
    acked: set[int] = set()
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "READY", line + (proc.stderr.read() if proc.stderr else "")
        while len(acked) < acks_wanted:
            line = proc.stdout.readline()
            assert line.startswith("ACK "), f"writer died: {line!r}"
            acked.add(int(line.split()[1]))
        proc.send_signal(signal.SIGKILL)  # with 8 writes in flight
        # acks already in the pipe were printed after write() returned: they count too
        rest, _ = proc.communicate(timeout=30)
        acked.update(int(x.split()[1]) for x in rest.splitlines() if x.startswith("ACK "))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    return acked


@pytest.mark.timeout(90)
def test_sigkill_mid_write_loses_nothing_acknowledged(
    backend_kind: str, make_backend: Callable[..., IOBackend], pool: BufferPool, tmp_path: Path
) -> None:
    root = tmp_path / "target"

    async def check(acked: set[int]) -> None:
        be = make_backend()
        eng = ChunkEngine(root, 1, be, pool)
        await eng.open()
        try:
            present = set(eng.keys())
            assert {_key(s) for s in acked} <= present
            for s in acked:
                view = await eng.read(_key(s))
                try:
                    assert bytes(view) == payload(s)
                finally:
                    eng.release(view)
            # fragments written but not yet acknowledged are whole or absent
            for k in present:
                await eng.verify(k)
                if k.inode not in acked:
                    view = await eng.read(k)
                    assert bytes(view) == payload(k.inode)
                    eng.release(view)
            assert eng.counters["corrupt"] == 0
            assert not os.listdir(root / "tmp")
        finally:
            await eng.close()
            await be.aclose()

    acked: set[int] = set()
    for round_no in range(2):
        acked |= _write_until_killed(root, backend_kind, 1_000_000 * (round_no + 1), 40)
        asyncio.run(check(acked))
