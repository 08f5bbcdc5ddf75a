"""Shared fixtures. Small and composable: each role's fixtures live in their
own library module (``tests/cluster.py`` for meta) and are exposed here."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# tests/engines drives the real engines and runs in .venv-engines (make
# engines; make test runs it there); the core venv has none of them.
collect_ignore = [] if importlib.util.find_spec("torch") is not None else ["engines"]

from tests.cluster import MetaCluster, meta_cluster_from_env, session_credentials  # noqa: E402

# Security is on by default: one cluster secret for the whole session, its
# admin token exported as TIERFS_TOKEN (this process and every daemon, CLI
# and benchmark it starts), its node key as every storage daemon's
# node_key_file, and the secret adopted by every new LocalCluster
# (docs/security.md, docs/testing.md).
session_credentials()
from tests.faults import LazyFS  # noqa: E402
from tests.faults.lazyfs import _mounted  # noqa: E402
from tests.skip_policy import (  # noqa: E402, F401 - hooks: a skip not allowed here fails
    pytest_collectreport,
    pytest_configure,
    pytest_make_collect_report,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_terminal_summary,
)


@pytest.fixture
def lazy(tmp_path: Path) -> Iterator[LazyFS]:
    """A LazyFS power-loss simulator mounted at ``tmp_path/"mnt"`` over
    ``tmp_path/"disk"`` (see docs/testing.md); never left mounted."""
    fs = LazyFS(tmp_path / "disk", tmp_path / "mnt")
    try:
        with fs:
            yield fs
    finally:
        if _mounted(fs.mountpoint):  # never leave a mount behind for later tests
            subprocess.run(["fusermount3", "-u", "-z", str(fs.mountpoint)], check=False)


@pytest.fixture
def meta_cluster(tmp_path: Path) -> Iterator[MetaCluster]:
    """Three real ``tierfs-meta`` replicas serving the real namespace
    (``MetaService``; use ``cluster.addresses`` with ``MetaClient``), or the
    deployment in TIERFS_TEST_META. Tests that kill or restart replicas get
    skipped against a deployment (``cluster.can_kill``)."""
    ext = meta_cluster_from_env()
    if ext is not None:
        yield ext
        return
    with MetaCluster(tmp_path / "meta", n=3, state_machine="meta") as cluster:
        cluster.wait_leader()
        yield cluster


@pytest.fixture
def meta_cluster_factory(tmp_path: Path) -> Iterator[type[MetaCluster]]:
    """Build clusters with custom options: ``meta_cluster_factory(n=5,
    state_machine="kv", extra_args=[...])`` (MetaCluster's keywords; the
    default state machine is the toy kv one); every cluster built is torn
    down after the test."""
    made: list[MetaCluster] = []

    def make(n: int = 3, **kw: object) -> MetaCluster:
        ext = meta_cluster_from_env()
        if ext is not None:
            made.append(ext)
            return ext
        c = MetaCluster(tmp_path / f"c{len(made)}", n=n, **kw)  # type: ignore[arg-type]
        made.append(c)
        return c

    yield make  # type: ignore[misc]
    for c in made:
        c.close()
