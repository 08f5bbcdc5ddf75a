"""The committed generated code matches proto/ (regenerated with pinned tools)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(60)
def test_generated_code_has_not_drifted() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True, text=True, timeout=50,
    )
    assert r.returncode == 0, r.stdout + r.stderr
