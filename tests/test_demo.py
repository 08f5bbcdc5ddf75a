"""`make run`'s demo for real: a local cluster (3 meta, 6 storage processes),
a checkpoint written, read back, read degraded after SIGKILL of a storage
daemon, the meta leader SIGKILLed; the cluster is left running, a second
run reuses it, and `tierfs down` stops it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierfs.local import LocalCluster, ProcInfo


@pytest.mark.timeout(240)
def test_demo_runs_leaves_the_cluster_up_and_reuses_it(tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    try:
        procs: list[ProcInfo] = []
        for attempt in range(2):
            r = subprocess.run([sys.executable, "-m", "tierfs.demo", "--data", str(data), "--size", "48MiB"],
                               capture_output=True, text=True, timeout=200)
            out = r.stdout + r.stderr
            assert r.returncode == 0, out
            assert "Traceback" not in out and "MISMATCH" not in out and "CHANGED" not in out, out
            assert out.count("checksum identical") == 2, out  # healthy read and degraded read
            assert "killed storage-2" in out and "restarted storage-2" in out, out
            assert "replica state digests identical" in out, out
            assert "cluster: healthy" in out and "groups: " in out, out
            assert f"tierfs down --data {data}" in out, out
            assert ("started 9 daemons" if attempt == 0 else "reusing the running cluster") in out, out
            # The commands it prints work as printed, from another directory
            # (no ./.tierfs there) and with no credential of the caller's own.
            env = {k: v for k, v in os.environ.items() if not k.startswith("TIERFS_")}
            for line in out.splitlines():
                if line.strip().startswith("export "):
                    k, _, v = line.strip()[len("export "):].partition("=")
                    env[k] = v
            assert "TIERFS_META" in env, out
            ls = subprocess.run([sys.executable, "-m", "tierfs.cli", "ls", "-l", "/demo/checkpoint"], env=env,
                                cwd=tmp_path, capture_output=True, text=True, timeout=60)
            assert ls.returncode == 0, ls.stdout + ls.stderr
            assert "ec:4+2" in ls.stdout or "replica" in ls.stdout, ls.stdout
            cl = LocalCluster.open(data)
            assert all(cl.running().values()), "the demo must leave the cluster running"
            procs += cl.procs
        r = subprocess.run([sys.executable, "-m", "tierfs.cli", "down", "--data", str(data)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "stopped 9 daemons" in r.stdout, r.stdout + r.stderr
        assert not any(p.alive() for p in procs)
    finally:
        if (data / "cluster.toml").exists():
            LocalCluster(data).stop()
