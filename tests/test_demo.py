"""`make run`'s demo against a real local cluster (3 meta, 6 storage processes)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tierfs.local import LocalCluster


@pytest.mark.timeout(240)
def test_demo_runs_and_reuses_its_data(tmp_path: Path) -> None:
    data = tmp_path / "cluster"
    try:
        for attempt in range(2):  # the second run reuses the same directory and ports
            r = subprocess.run([sys.executable, "-m", "tierfs.demo", "--data", str(data)],
                               capture_output=True, text=True, timeout=200)
            out = r.stdout + r.stderr
            assert r.returncode == 0, out
            assert "acknowledged entries missing after failover: 0" in out, out
            assert "replica state digests identical" in out, out
            assert "MISMATCH" not in out and "identical (sha256" in out, out
            assert "decoded from parity): identical" in out, out
            assert (data / "cluster.toml").exists()
            if attempt == 1:
                assert out.count("/demo/run-") >= 1
        assert not any(LocalCluster(data).running().values()), "demo left daemons running"
    finally:
        LocalCluster(data).stop() if (data / "cluster.toml").exists() else None
