"""``python -m bench.run`` as a user runs it (bench/README.md): a name
``--only`` does not know is an error, not an empty run that exits 0; and
the files a benchmark writes itself (``kv.md``, ``training.md``) go where
``--out`` says, beside its JSON, not over the committed results in
bench/results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(120)


def test_only_with_an_unknown_name_fails_and_names_the_benchmarks(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for only in (["bench_meta"], ["meta", "nosuch"], []):
        r = subprocess.run([sys.executable, "-m", "bench.run", "--quick", "--only", *only, "--out", str(out)],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
        assert r.returncode == 2, (only, r.returncode, r.stdout, r.stderr)
        assert "no benchmark named" in r.stderr and "dataplane" in r.stderr, r.stderr
        assert not out.exists()  # nothing was run, nothing written


def test_bench_kv_refuses_a_part_or_transport_it_does_not_know() -> None:
    """``python -m bench.bench_kv --only tierfs,redsi`` ran the TierFS part
    and skipped the typo without a word (until stop 49)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args, want in ((["--only", "tierfs,redsi"], "no part named 'redsi'"),
                       (["--transports", "tcp,rdma"], "no transport named 'rdma'")):
        r = subprocess.run([sys.executable, "-m", "bench.bench_kv", "--quick", *args], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=100)
        assert r.returncode == 2 and want in r.stderr, (args, r.returncode, r.stdout[-500:], r.stderr)


def test_out_takes_the_files_a_benchmark_writes_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.run
    from bench.common import results_dir

    monkeypatch.delenv("TIERFS_BENCH_RESULTS", raising=False)
    real_import = bench.run.importlib.import_module

    def fake_run(quick: bool) -> dict[str, Any]:
        (results_dir(quick) / "training.md").write_text("the benchmark's own table\n")
        return {"name": "training", "rows": [], "notes": ""}

    def fake_import(name: str) -> Any:
        if name == "bench.bench_training":
            return types.SimpleNamespace(run=fake_run)
        return real_import(name)

    monkeypatch.setattr(bench.run.importlib, "import_module", fake_import)
    committed = REPO / "bench" / "results" / "training.md"
    before = committed.read_text() if committed.exists() else None
    for quick in (False, True):
        out = tmp_path / f"out-{quick}"
        try:
            assert bench.run.main(["--only", "training", "--out", str(out), *(["--quick"] if quick else [])]) == 0
        finally:
            monkeypatch.delenv("TIERFS_BENCH_RESULTS", raising=False)
        assert (out / "training.md").read_text() == "the benchmark's own table\n"
        assert json.loads((out / "training.json").read_text())["name"] == "training"
        assert (committed.read_text() if committed.exists() else None) == before


def test_fuse_bench_notes_name_the_mount_defaults() -> None:
    # The notes printed "read-ahead <member 'read_ahead_kib' of 'MountConfig' objects> KiB".
    from bench.bench_fuse import _mount_defaults
    from tierfs.fuse.mount import MountConfig

    d = MountConfig("", [])
    assert _mount_defaults() == f"attr timeout {d.attr_timeout:g} s, read-ahead {d.read_ahead_kib} KiB"
    assert "member" not in _mount_defaults()
