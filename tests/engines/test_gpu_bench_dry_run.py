"""The GPU benchmark and check script keep working where no GPU is (CI):
``bench.gpu_kv --device cpu`` runs every code path it can without CUDA (the
copies, client.kv over tcp and shm against a real local cluster, the
prefill of a 1-layer model) and writes its JSON and Markdown;
``scripts/gpu_check.sh`` parses. On a GPU machine the same code is what
scripts/gpu_check.sh runs (docs/kv_tiers.md, "GPU path")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)


def test_gpu_bench_dry_run_writes_its_results(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "bench.gpu_kv", "--device", "cpu", "--tokens", "64", "--reps", "1",
                        "--storage", "2", "--transports", "tcp,shm", "--prefill-tokens", "16", "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "gpu_kv.json").read_text())
    assert res["objects"] == 4 and res["object_bytes"] == 2 << 20
    for t in ("tcp", "shm"):
        c = res["cluster"][t]
        assert "error" not in c, c.get("error")
        assert len(c["get_cuda_s"]) == 1 and c["cpu"]["get_host"]["wall_s"] > 0
    assert "prefill_s" in res["prefill_16"], res["prefill_16"]
    md = (out / "gpu_kv.md").read_text()
    assert "TierFS (shm) batch_get_into CUDA tensors" in md and "prefill (recompute) of 16 tokens" in md


def test_gpu_check_script_parses() -> None:
    r = subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
