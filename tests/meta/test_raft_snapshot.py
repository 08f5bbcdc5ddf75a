"""Snapshots bound the journal; replicas restart from snapshot + journal tail."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import MetaCluster, meta_cluster_from_env, wait_for
from tierfs.meta.journal import DurableJournal, read_snapshot
from tierfs.meta.raft import SNAPSHOT_FILE


@pytest.mark.timeout(120)
def test_restart_from_snapshot_plus_journal(tmp_path: Path) -> None:
    if meta_cluster_from_env() is not None:
        pytest.skip("restarts replicas: needs a local cluster")
    with MetaCluster(tmp_path, n=3, extra_args=["--snapshot-min-entries", "50"]) as c:
        c.wait_leader()
        for i in range(230):
            c.put(f"k{i}", f"v{i}")
        # every replica compacted: a snapshot on disk and a short journal
        for r in c.replicas:
            snap = wait_for(lambda r=r: (r.data_dir / SNAPSHOT_FILE).exists(), 60, "a snapshot")
            assert snap
        # ... and compacted up to the end: the child that writes a snapshot
        # runs at nice 19 and may lag behind the writes on a loaded host
        def compacted() -> bool:
            return all(s.raft.snapshots >= 1 and s.raft.log_len <= 60 for s in (c.status(i) for i in range(3)))

        wait_for(compacted, 60, "every replica's journal compacted")
        before = c.wait_converged(30)

        for i in range(3):
            c.stop(i)  # clean stop
        # the files a restart will read: snapshot + journal tail after it
        for r in c.replicas:
            snap = read_snapshot(r.data_dir / SNAPSHOT_FILE)
            j = DurableJournal(r.data_dir, anchor=snap.anchor)
            assert j[0][1] == snap.prev[1] and j.last_index >= snap.last[1]
            assert j.last_index - j[0][1] < 60
            j.close()
        # a snapshot a killed replica's child left half written is removed at start
        stale = c.replicas[0].data_dir / (SNAPSHOT_FILE + ".new.4242.1")
        stale.write_bytes(b"half a snapshot")
        for i in range(3):
            c.start(i)
        c.wait_leader()
        assert c.wait_converged(30) == before
        assert not stale.exists()
        vals = c.get_many([f"k{i}" for i in range(230)])
        assert vals == {f"k{i}": f"v{i}" for i in range(230)}

        # SIGKILL one follower, write on, restart it: snapshot + journal + catch-up
        leader = c.wait_leader()
        f = (leader + 1) % 3
        c.kill(f)
        for i in range(230, 330):
            c.put(f"k{i}", f"v{i}")
        c.start(f)
        c.wait_converged(30)
        assert c.get_many([f"k{i}" for i in range(330)], i=c.wait_leader()) == {f"k{i}": f"v{i}" for i in range(330)}
        for i in range(3):
            assert "may have diverged" not in c.log(i)


@pytest.mark.timeout(30)
def test_a_snapshot_that_cannot_be_put_in_place_fails_without_a_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The tick thread's check of a finished snapshot: when the rename into
    place fails (the data directory's disk or mount died under the replica,
    as in the power-loss test), the snapshot is reported failed (pysyncobj
    tries again later; the journal still holds every entry) with one error
    line, not an exception out of the tick (a traceback in the log)."""
    import time

    from tierfs.meta.raft import _SER_DONE, _SER_FAILED, RaftReplicator

    r = object.__new__(RaftReplicator)  # only the check's own state
    r.node_id, r._dir, r._fork_failures, r.snapshots_written = "m0", tmp_path, 0, 0
    r._snap_pid, r._snap_started = -1, (time.monotonic(), 0.0, 7)  # written in-process, index 7
    r._snap_tmp = tmp_path / (SNAPSHOT_FILE + ".new.1.1")
    # No snapshot.bin.new.1.1 to rename: the rename fails with an OSError.
    with caplog.at_level("ERROR", logger="tierfs.meta.raft"):
        assert r._check_snapshot() == _SER_FAILED
    assert "snapshot for index 7 not put in place" in caplog.text
    assert not (tmp_path / SNAPSHOT_FILE).exists() and r.snapshots_written == 0 and r._snap_pid == 0

    # each snapshot has a file of its own: the checker renames that one,
    # never another child's
    (tmp_path / (SNAPSHOT_FILE + ".new.1.1")).write_bytes(b"old")
    (tmp_path / (SNAPSHOT_FILE + ".new.1.2")).write_bytes(b"snap")
    r._snap_tmp = tmp_path / (SNAPSHOT_FILE + ".new.1.2")
    r._snap_pid, r._snap_started = -1, (time.monotonic(), 0.0, 8)
    assert r._check_snapshot() == _SER_DONE
    assert (tmp_path / SNAPSHOT_FILE).read_bytes() == b"snap" and r.snapshots_written == 1


@pytest.mark.timeout(60)
def test_a_snapshot_child_dies_with_its_replica(tmp_path: Path) -> None:
    """A replica SIGKILLed (OOM, kill -9) while its snapshot child works
    took the child with it only when the child finished: at nice 19 on a
    loaded host children were seen outliving their replica by tens of
    seconds, long enough to overlap the restarted replica's own snapshot."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    code = ("import time\n"
            "from tierfs.meta.raft import _fork_child\n"
            "pid = _fork_child(lambda: time.sleep(120))\n"
            "print(pid, flush=True)\n"
            "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())

        def running(pid: int) -> bool:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] != "Z"
            except FileNotFoundError:
                return False

        wait_for(lambda: running(child), 10, "the child")
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_for(lambda: not running(child), 15, "the child to die with its parent")
    finally:
        parent.kill()
        parent.wait(10)
        parent.stdout.close()  # type: ignore[union-attr]
        with contextlib.suppress(NameError, ProcessLookupError):
            os.kill(child, signal.SIGKILL)
