"""Power loss (LazyFS drops every unsynced change) in the middle of a stream
of fragment writes: every acknowledged fragment survives, nothing torn is
visible, only what the engine fsynced exists."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults import LazyFS
from tests.storage.crash_writer import payload
from tierfs.buffers import BufferPool
from tierfs.storage.api import FragmentKey
from tierfs.storage.engine import ChunkEngine
from tierfs.storage.io import open_backend

REPO = Path(__file__).resolve().parents[2]
WRITER = Path(__file__).with_name("crash_writer.py")


def _key(seed: int) -> FragmentKey:
    return FragmentKey(seed, seed % 7, seed % 3, 1)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not LazyFS.available(), reason="needs /dev/fuse and fusermount3")
def test_power_loss_mid_stream_keeps_every_acknowledged_fragment(tmp_path: Path) -> None:
    fs = LazyFS(tmp_path / "disk", tmp_path / "mnt")
    fs.mount()
    try:
        root = tmp_path / "mnt" / "target"
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.Popen(
            [sys.executable, str(WRITER), str(root), "posix", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
        )
        acked: set[int] = set()
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.strip() == "READY", line
            while len(acked) < 25:
                line = proc.stdout.readline()
                assert line.startswith("ACK "), f"writer died: {line!r}"
                acked.add(int(line.split()[1]))
            fs.power_loss()  # first: nothing after this instant persists
            proc.send_signal(signal.SIGKILL)
            rest, _ = proc.communicate(timeout=30)
            # an ACK printed before the cut was durable when printed
            acked.update(int(x.split()[1]) for x in rest.splitlines() if x.startswith("ACK "))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        fs.mount()  # reboot: only the durable state is there

        async def check() -> None:
            pool = BufferPool(64 << 20)
            be = open_backend("posix", pool)
            eng = ChunkEngine(root, 1, be, pool)
            await eng.open()
            try:
                present = set(eng.keys())
                missing = {_key(s) for s in acked} - present
                assert not missing, f"acknowledged fragments lost: {sorted(missing)[:5]}"
                for k in present:
                    view = await eng.read(k)
                    try:
                        assert bytes(view) == payload(k.inode)
                    finally:
                        eng.release(view)
                assert eng.counters["corrupt"] == 0
                assert not os.listdir(root / "tmp")
            finally:
                await eng.close()
                await be.aclose()
                pool.close()

        asyncio.run(check())
    finally:
        fs.unmount()
