"""Shared fixtures. Small and composable: each role's fixtures live in their
own library module (``tests/cluster.py`` for meta) and are exposed here."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Every meta state machine in the suite, in this process and in the daemons
# it starts, checks its per-map-version placement cache against a fresh
# computation on each create (tierfs.meta.state._groups_online).
os.environ.setdefault("TIERFS_TEST_CHECK_PLACEMENT_CACHE", "1")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))



def _worker_port_range() -> None:
    """Under pytest-xdist (make test runs two workers) each worker draws
    its loopback ports from its own slice of the range
    (``TIERFS_PORT_RANGE``, read by tierfs.local.free_ports and inherited
    by every daemon and CLI a test starts): ports one worker released for
    its daemons cannot be drawn by another before they bind them (seen:
    EADDRINUSE at a storage daemon's start)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if not worker.startswith("gw") or count < 2:
        return
    from tierfs.local import _ephemeral_range

    lo, hi = 10000, max(_ephemeral_range()[0] - 1, 12048)
    if os.environ.get("TIERFS_PORT_RANGE", "").strip():
        lo, hi = (int(x) for x in os.environ["TIERFS_PORT_RANGE"].split("-", 1))
    i = int(worker[2:])
    step = (hi - lo + 1) // count
    os.environ["TIERFS_PORT_RANGE"] = f"{lo + i * step}-{lo + (i + 1) * step - 1}"


_worker_port_range()

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


def _ancestors() -> set[int]:
    """This process and every process above it (a ``timeout`` or shell that
    started pytest with ``--basetemp=DIR`` names DIR too)."""
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def _leftovers(root: str) -> list[tuple[int, str]]:
    """Processes (not this one, nor those above it) whose command line
    names a path under ``root``: the daemons, mounts and helpers tests
    started there."""
    out = []
    mine = _ancestors()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in mine:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(root in a for a in argv) and not _dying(d):
            out.append((int(d), " ".join(argv)[:160]))
    return out


def _dying(pid: str) -> bool:
    """SIGKILL is pending for it (a meta replica's snapshot child, killed
    with its replica, that a loaded host has not run yet): not a leftover."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & (1 << 8):
                    return True
    except (OSError, ValueError, IndexError):
        pass
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After a module's last test (its fixtures torn down), SIGKILL what its
    tests started under the session's temp directory and left running, and
    lazily unmount its FUSE mounts there. A test killed by pytest-timeout
    in the middle of its own clean-up used to leave a whole cluster
    running for the rest of the suite (two cores shared with it). Named in
    the report, so the test that leaked can be fixed. tests/engines is
    left alone: its cluster is session-scoped."""
    yield
    if nextitem is not None and nextitem.path == item.path:
        return
    if "engines" in item.path.parts:
        return
    try:
        root = str(item.config._tmp_path_factory.getbasetemp())  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return
    import signal

    left = _leftovers(root)
    for pid, _ in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    mounts = []
    try:
        with open("/proc/mounts") as f:
            mounts = [ln.split()[1] for ln in f if ln.split()[1].startswith(root)]
    except OSError:
        pass
    for m in mounts:
        subprocess.run(["fusermount3", "-u", "-z", m], check=False, capture_output=True)
    if left or mounts:
        sys.stderr.write(f"\n{item.path.name}: killed {len(left)} process(es) and unmounted {len(mounts)} "
                         f"mount(s) its tests left behind: " + "; ".join(c for _, c in left[:4]) + "\n")


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
