"""The FUSE mount while storage daemons stall: what an application reading
through it sees. Its own cluster (every storage daemon is stopped here)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.client.util import digest, random_bytes, start_cluster
from tests.fuse.util import Mount
from tierfs.client import Client
from tierfs.local import LocalCluster

MiB = 1 << 20


@pytest.fixture
def stall_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cl = start_cluster(tmp_path / "cluster", n_storage=3)
    try:
        yield cl
    finally:
        cl.stop()


def _read_until_ok(path: Path, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return path.read_bytes()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.timeout(180)
def test_a_read_during_a_whole_cluster_stall_fails_after_one_round_of_retries(
        stall_cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every storage daemon stalled (SIGSTOP): ``read(2)`` of a replica:3 file
    fails with EIO after the client's retries have run once. The kernel sends
    that one read as several FUSE requests (its read-ahead, then the page
    again once the read-ahead failed), all in the same chunk; each ran the
    client's retries on the stalled nodes in turn, so ``cat`` of an 8 MiB
    file took 91 s instead of 30 s (with the default 10 s request timeout),
    and the mount's log said nothing. Now the requests asked while (or right
    after) a read of that chunk failed share its error, and the failure is
    logged once."""
    cl = stall_cluster
    data = random_bytes(2 * MiB + 5, seed=5)
    with Client(cl.meta_addrs, request_timeout=5.0) as client:
        client.mkdir("/r3")
        client.set_layout("/r3", redundancy="replica:3")
        client.write_bytes("/r3/warm", data[:MiB])
        client.write_bytes("/r3/f", data)
        ino = client.stat("/r3/f").inode
    monkeypatch.setenv("TIERFS_REQUEST_TIMEOUT", "1s")
    m = Mount(tmp_path / "mnt", cl.meta_addrs, tmp_path / "mount.log", "--debug")
    try:
        assert (m.path / "r3" / "warm").read_bytes() == data[:MiB]  # the mount's connections are open
        pids = [p.pid for p in cl.procs if p.name.startswith("storage-")]
        assert len(pids) == 3
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(OSError) as err:
                (m.path / "r3" / "f").read_bytes()
            assert err.value.errno == errno.EIO
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        failed = re.findall(rf"read of inode {ino} at \d+ \(\d+ bytes\) failed after [\d.]+ s, "
                            rf"the application gets EIO: .*unreadable", m.log_text())
        assert len(failed) == 1, m.log_text()[-4000:]
        # The kernel's other requests for that chunk failed with it, without retries of their own.
        assert re.search(rf"read of inode {ino} at \d+ \(\d+ bytes\): fails as the read of chunks 0-0 did",
                         m.log_text()), m.log_text()[-4000:]
        # The nodes are back: a new open reads the file whole.
        assert digest(_read_until_ok(m.path / "r3" / "f", 60)) == digest(data)
    finally:
        m.close()
