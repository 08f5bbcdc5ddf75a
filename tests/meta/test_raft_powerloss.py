"""Power loss on every meta replica at once, simulated with LazyFS (a FUSE
file system that keeps unsynced writes in memory and drops them on
``power_loss()``): every acknowledged write must survive."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import MetaCluster, meta_cluster_from_env
from tests.faults import LazyFS


@pytest.mark.timeout(180)
def test_acknowledged_writes_survive_power_loss_of_all_replicas(tmp_path: Path) -> None:
    if meta_cluster_from_env() is not None:
        pytest.skip("needs local replicas on a simulated disk")
    if not LazyFS.available():
        pytest.skip("LazyFS needs /dev/fuse and fusermount3")
    fs = LazyFS(tmp_path / "disk", tmp_path / "mnt")
    fs.mount()
    c = MetaCluster(tmp_path / "logs", n=3, data_root=tmp_path / "mnt", start=False,
                    extra_args=["--snapshot-min-entries", "60"])
    try:
        for i in range(3):
            c.start(i)
        c.wait_leader()
        acked = {}
        for i in range(200):  # crosses several snapshots / journal rewrites
            c.put(f"k{i}", f"v{i}")
            acked[f"k{i}"] = f"v{i}"
        assert fs.stats()["dirty_bytes"] >= 0
        fs.power_loss()  # everything not fsynced is gone, on all three at once
        for i in range(3):
            c.kill(i)
        fs.mount()  # reboot: only durable state
        for i in range(3):
            c.start(i)
        c.wait_leader()
        assert c.get_many(sorted(acked)) == acked
        c.wait_converged(30)
        c.put("after", "reboot")
        for i in range(3):
            assert "Traceback" not in c.log(i)
    finally:
        c.close()
        if fs.mounted:
            fs.unmount()
