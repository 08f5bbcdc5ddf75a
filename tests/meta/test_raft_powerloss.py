"""Power loss on every meta replica at once, simulated with LazyFS (a FUSE
file system that keeps unsynced writes in memory and drops them on
``power_loss()``): every acknowledged write must survive, including writes
that were in flight when the power went."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.cluster import MetaCluster, meta_cluster_from_env, wait_for
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
    acked: dict[str, str] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def writer(w: int) -> None:
        i = 0
        while not stop.is_set():
            k, v = f"w{w}-{i}", str(i)
            try:
                c.put(k, v, timeout=3)
            except TimeoutError:
                return  # the power is gone
            with lock:
                acked[k] = v
            i += 1

    threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(3)]
    try:
        for i in range(3):
            c.start(i)
        c.wait_leader()
        for t in threads:
            t.start()
        # enough writes to cross several snapshots / journal rewrites
        wait_for(lambda: len(acked) >= 300, 60, "300 acknowledged puts")
        fs.power_loss()  # mid-stream: everything not fsynced is gone, on all three at once
        stop.set()
        for t in threads:
            t.join(30)
        for i in range(3):
            c.kill(i)
        fs.mount()  # reboot: only durable state
        for i in range(3):
            c.start(i)
        c.wait_leader()
        # Every ack ever received counts: an ack needs an fdatasync that
        # completed, and after the cut every fdatasync fails.
        got = c.get_many(sorted(acked))
        missing = {k: v for k, v in acked.items() if got[k] != v}
        assert not missing, f"{len(missing)} of {len(acked)} acknowledged puts lost: {sorted(missing)[:5]}"
        c.wait_converged(30)
        c.put("after", "reboot")
        for i in range(3):
            assert "Traceback" not in c.log(i)
    finally:
        stop.set()
        c.close()
        if fs.mounted:
            fs.unmount()
