"""The skip policy (tests/skip_policy.py) on a throwaway suite run by a real
pytest: which skips fail, which the environment allows, and that a typo in
TIERFS_ALLOW_SKIP stops the run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.skip_policy import category

REPO = Path(__file__).resolve().parent.parent

SUITE = '''
import pytest

def test_fuse():
    pytest.skip("needs /dev/fuse and fusermount3")

@pytest.mark.skipif(True, reason="no RDMA device / pyverbs here")
def test_rdma():
    pass

def test_netns():
    pytest.skip("ip netns add is not permitted: Operation not permitted")

def test_unknown():
    pytest.skip("some new reason")

@pytest.mark.xfail(reason="expected", strict=True)
def test_xfail():
    assert False

def test_ok():
    pass
'''


def _run(tmp_path: Path, allow: str | None, *extra_files: tuple[str, str],
         args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(
        "from tests.skip_policy import pytest_collectreport, pytest_configure, pytest_make_collect_report, "
        "pytest_runtest_logreport, pytest_runtest_makereport, pytest_terminal_summary  # noqa: F401\n")
    (tmp_path / "test_suite.py").write_text(SUITE)
    for name, text in extra_files:
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k not in ("TIERFS_ALLOW_SKIP", "TIERFS_TEST_META")}
    env["PYTHONPATH"] = str(REPO)
    if allow is not None:
        env["TIERFS_ALLOW_SKIP"] = allow
    return subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *args, str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120, check=False)


def _outcomes(out: str) -> dict[str, str]:
    """test name -> outcome, from the ``-v`` progress lines (``path::name OUTCOME``)."""
    res = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and "::" in parts[0] and parts[1] in ("PASSED", "FAILED", "SKIPPED", "XFAIL", "ERROR"):
            res[parts[0].split("::")[-1]] = parts[1]
    return res


@pytest.mark.timeout(120)
def test_skips_fail_unless_allowed(tmp_path: Path) -> None:
    r = _run(tmp_path, None)
    got = _outcomes(r.stdout)
    assert r.returncode == 1, r.stdout
    assert got == {"test_fuse": "FAILED", "test_rdma": "SKIPPED", "test_netns": "FAILED",
                   "test_unknown": "FAILED", "test_xfail": "XFAIL", "test_ok": "PASSED"}, r.stdout
    assert "a skip is an error here: [fuse] needs /dev/fuse" in r.stdout
    assert "TIERFS_ALLOW_SKIP=fuse" in r.stdout

    r = _run(tmp_path, "fuse, netns")
    got = _outcomes(r.stdout)
    assert (got["test_fuse"], got["test_netns"], got["test_unknown"]) == ("SKIPPED", "SKIPPED", "FAILED"), r.stdout
    assert "allowed skips: fuse x1, netns x1, rdma x1" in r.stdout

    r = _run(tmp_path, "all")
    assert r.returncode == 0, r.stdout
    assert set(_outcomes(r.stdout).values()) == {"SKIPPED", "XFAIL", "PASSED"}


@pytest.mark.timeout(120)
def test_policy_holds_under_xdist(tmp_path: Path) -> None:
    """make test runs the suite with pytest-xdist (-n 2): the workers turn a
    skip into a failure, and the controller counts the allowed ones."""
    pytest.importorskip("xdist", reason="pytest-xdist not installed")
    r = _run(tmp_path, None, args=("-n", "2"))
    assert r.returncode == 1, r.stdout
    for name in ("test_fuse", "test_netns", "test_unknown"):
        assert f"FAILED test_suite.py::{name}" in r.stdout, r.stdout
    r = _run(tmp_path, "fuse, netns", args=("-n", "2"))
    assert "allowed skips: fuse x1, netns x1, rdma x1" in r.stdout, r.stdout


@pytest.mark.timeout(120)
def test_module_level_skip_and_unknown_category(tmp_path: Path) -> None:
    mod = ("test_mod.py", "import pytest\npytest.skip('LazyFS needs /dev/fuse', allow_module_level=True)\n")
    r = _run(tmp_path, None, mod)
    assert r.returncode != 0 and "[fuse] LazyFS needs /dev/fuse" in r.stdout, r.stdout
    r = _run(tmp_path, "fsue")
    assert r.returncode == 4 and "unknown category fsue" in r.stdout + r.stderr, r.stdout + r.stderr


def test_the_suites_own_skip_reasons_have_their_categories() -> None:
    assert category("needs /dev/fuse and fusermount3") == "fuse"
    assert category("LazyFS needs /dev/fuse and fusermount3") == "fuse"
    assert category("ip netns add is not permitted: x") == "netns"
    assert category("no free 10.200.<n>.0/24 subnet") == "netns"
    assert category("needs root and mount(8) to create a small tmpfs target") == "mount"
    assert category("cannot loop-mount: x") == "mount"
    assert category("mkfs.ext4 not installed") == "mount"
    assert category("io_uring setup failed: [Errno 1]") == "uring"
    assert category("kubectl not installed") == "tools"
    assert category("needs root to run a process as another user") == "root"
    assert category("kills replicas: needs a local cluster") == "deployment"
    assert category("no RDMA device / pyverbs here") == "rdma"
    assert category("something else") == "other"
