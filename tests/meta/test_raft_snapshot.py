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
            snap = wait_for(lambda r=r: (r.data_dir / SNAPSHOT_FILE).exists(), 20, "a snapshot")
            assert snap
        statuses = [c.status(i) for i in range(3)]
        assert all(s.raft.snapshots >= 1 for s in statuses), statuses
        assert all(s.raft.log_len <= 60 for s in statuses), statuses
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
        for i in range(3):
            c.start(i)
        c.wait_leader()
        assert c.wait_converged(30) == before
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
    # No snapshot.bin.new to rename: the rename fails with an OSError.
    with caplog.at_level("ERROR", logger="tierfs.meta.raft"):
        assert r._check_snapshot() == _SER_FAILED
    assert "snapshot for index 7 not put in place" in caplog.text
    assert not (tmp_path / SNAPSHOT_FILE).exists() and r.snapshots_written == 0 and r._snap_pid == 0

    (tmp_path / (SNAPSHOT_FILE + ".new")).write_bytes(b"snap")
    r._snap_pid, r._snap_started = -1, (time.monotonic(), 0.0, 8)
    assert r._check_snapshot() == _SER_DONE
    assert (tmp_path / SNAPSHOT_FILE).read_bytes() == b"snap" and r.snapshots_written == 1
