"""The README's "Using it" commands, run as a new user would paste them: a
fresh directory, no TIERFS_* in the environment, ``bash -e`` (every line
must succeed). Before stop 34 its first ``put`` failed (no /models), and
``get -r /data/dataset`` found nothing (``put -r ./dataset /data`` made
/data the copy)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _using_it_block() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Using it\n", 1)[1]
    m = re.search(r"```sh\n(.*?)```", section, re.S)
    assert m, "README's 'Using it' section has no sh block"
    return m.group(1)


@pytest.mark.timeout(240)
def test_the_readme_using_it_commands_run_as_written(tmp_path: Path) -> None:
    block = _using_it_block()
    assert "tierfs up --data ./.tierfs" in block and "tierfs down --data ./.tierfs" in block
    (tmp_path / ".venv").symlink_to(sys.prefix)  # the commands call .venv/bin/tierfs
    (tmp_path / "model.safetensors").write_bytes(os.urandom(3 << 20))
    (tmp_path / "dataset" / "sub").mkdir(parents=True)
    (tmp_path / "dataset" / "a.bin").write_bytes(os.urandom(300_000))
    (tmp_path / "dataset" / "sub" / "b.txt").write_text("hello\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERFS_")}
    try:
        r = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=200)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        for rel in ("a.bin", "sub/b.txt"):
            assert (tmp_path / "copy" / rel).read_bytes() == (tmp_path / "dataset" / rel).read_bytes()
        assert "ec:4+2" in r.stdout  # ls -l shows the layout
        assert "stopped 9 daemons" in r.stdout + r.stderr
    finally:
        if (tmp_path / ".tierfs" / "cluster.toml").exists():
            subprocess.run([sys.executable, "-m", "tierfs.cli", "down", "--data", str(tmp_path / ".tierfs")],
                           env=env, capture_output=True, timeout=60)
