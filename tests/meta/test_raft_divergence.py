"""Heavy writes + log compaction + SIGKILL and clean restarts + a membership
change: every replica must end with the same state, nothing acknowledged may
be missing, and pysyncobj must never truncate entries it already applied
(its "may have diverged" warning; see docs/raft.md for the cause and fix)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.cluster import MetaCluster, meta_cluster_from_env, wait_for


@pytest.mark.timeout(180)
def test_heavy_writes_compaction_restarts_membership_converge(tmp_path: Path) -> None:
    if meta_cluster_from_env() is not None:
        pytest.skip("kills replicas: needs a local cluster")
    acked: dict[str, str] = {}
    lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(c: MetaCluster, w: int) -> None:
        i = 0
        try:
            while not stop.is_set():
                k = f"w{w}-{i}"
                c.put(k, str(i), timeout=30)
                with lock:
                    acked[k] = str(i)
                i += 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with MetaCluster(tmp_path, n=3, extra_args=["--snapshot-min-entries", "40"]) as c:
        c.wait_leader()
        threads = [threading.Thread(target=writer, args=(c, w), daemon=True) for w in range(4)]
        for t in threads:
            t.start()

        def progress(n: int) -> None:
            with lock:
                target = len(acked) + n
            wait_for(lambda: len(acked) >= target or errors, 60, f"{n} more acks")

        try:
            progress(150)
            for _ in range(2):
                leader = c.wait_leader()
                f = (leader + 1) % 3
                c.kill(f)  # SIGKILL a follower
                progress(80)
                c.start(f)
                progress(80)
                c.kill(c.wait_leader())  # SIGKILL the leader
                progress(80)
                for i in (0, 1, 2):
                    if not c.replicas[i].alive:
                        c.start(i)
                progress(80)
                leader = c.wait_leader()
                c.stop(leader)  # clean restart of the leader
                c.start(leader)
                progress(80)
            # membership change under load
            new = c.add_replica()
            c.add_member(c.wait_leader(), new, timeout=20)
            progress(150)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert not errors, errors
        t0 = time.monotonic()
        digest = c.wait_converged(60, members=[0, 1, 2, new])
        print(f"{len(acked)} acked puts; converged in {time.monotonic() - t0:.2f}s to {digest[:16]}")
        vals = c.get_many(sorted(acked))
        missing = {k: v for k, v in acked.items() if vals.get(k) != v}
        assert not missing, f"{len(missing)} acknowledged puts missing, e.g. {list(missing.items())[:5]}"
        snaps = 0
        for i in (0, 1, 2, new):
            log = c.log(i)
            assert "may have diverged" not in log, f"replica {i} truncated applied entries:\n{log[-3000:]}"
            assert "Traceback" not in log, log[-3000:]
            snaps += log.count("snapshot at index")
        assert snaps >= 6, "the test must exercise log compaction"
