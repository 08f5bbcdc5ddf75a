"""A rebalance move whose new member fills up, on real daemons: 4 storage
nodes with 9 MiB of ec:2+1 fragments grow to 5, the new node's only target
on a 4 MiB tmpfs (no reserve, ``min_free`` 128 KiB: online when it starts)
that copies slowly; the rebalancer moves groups onto it (816 KiB of
fragment files each, as many as its free space takes), then other data
fills the file system, the copies run out of room, the target turns
read-only, and no move can finish.

What it proves: ``GetRebalanceStatus`` names each such move and why
("destination target T is full (read-only)"), and ``tierfs rebalance
status`` and ``tierfs status`` print it (before, both said only "moving (2
moving, 0 planned, ...)" for ever, with no error). Draining the full node,
the way out the message gives, moves the copies elsewhere: the moves
finish and every file reads back byte for byte. So does the leader, by
itself, once such a move has waited ``rebalance_redirect_after``."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import wait_for
from tests.repair.util import random_bytes, start
from tierfs.cli.main import run
from tierfs.client import AsyncClient
from tierfs.errors import NoSpaceError
from tierfs.local import LocalCluster, ProcInfo
from tierfs.meta import MetaClient
from tierfs.proto.v1 import meta_pb2 as pb

KiB = 1024
CHUNK = 128 * KiB
META = ("--heartbeat-timeout=1.5", "--replace-after=30", "--tick-interval=0.2", "--rebalance=true",
        "--rebalance-interval=0.5", "--rebalance-max-moving=4", "--rebalance-redirect-after=0")


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[LocalCluster, list[Path]]]:
    redirect = getattr(request, "param", 0)
    cl = start(tmp_path / "c", n_storage=4, meta_args=(*META[:-1], f"--rebalance-redirect-after={redirect}"))
    mounts: list[Path] = []
    try:
        yield cl, mounts
    finally:
        cl.stop()
        for m in mounts:
            subprocess.run(["umount", str(m)], capture_output=True, timeout=30)


def cli(meta: list[str], *args: str, ok: tuple[int, ...] = (0,)) -> str:
    out, err = io.StringIO(), io.StringIO()
    rc = run([*args, "--meta", ",".join(meta)], stdout=out, stderr=err,
             env={"TIERFS_TOKEN": os.environ["TIERFS_TOKEN"]}, tty=False)
    assert rc in ok, (rc, out.getvalue(), err.getvalue())
    return out.getvalue()


async def rebalance_status(meta: list[str]) -> pb.RebalanceStatus:
    async with MetaClient(meta, deadline=10) as mc:
        return await mc.rebalance_status()


def _grow_onto_tmpfs(cl: LocalCluster, mounts: list[Path], d: str, *, seed: int, min_free: str,
                     size: str = "768k", storage_args: tuple[str, ...] = ()) -> tuple[dict[str, bytes], ProcInfo]:
    """12 files of ec:2+1 in ``d``, then a fifth node whose only target is a
    tmpfs of ``size`` (no reserve, ``min_free`` as given), started. The files
    written and the new daemon (skips the test where tmpfs cannot be mounted)."""
    meta = list(cl.meta_addrs)
    files = {f"{d}/f{i}": random_bytes(4 * CHUNK, seed + i) for i in range(12)}

    async def write() -> None:
        async with AsyncClient(meta) as c:
            await c.mkdir(d, exist_ok=True)
            await c.set_layout(d, chunk_size=CHUNK, redundancy="ec:2+1")
            for path, data in files.items():
                await c.write_bytes(path, data)

    asyncio.run(write())
    (name,) = cl.grow(5)
    p = cl.proc(name)
    target = Path(next(a.split("=", 1)[1] for a in p.argv if a.startswith("--target=")))
    target.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"tmpfs mount not permitted here: {r.stderr.strip()}")
    mounts.append(target)
    p.argv += ["--reserved-bytes=0", f"--min-free={min_free}", *storage_args]
    cl.start(timeout=60)
    return files, p


#: The new node copies at 256 KiB/s: a move onto it takes seconds, time to
#: fill its file system under the copies.
SLOW_COPY = ("--rebuild-rate=256KiB",)


async def _target_of(meta: list[str], p: ProcInfo) -> tuple[int, pb.ClusterMap] | None:
    async with MetaClient(meta, deadline=10) as mc:
        cmap = await mc.get_cluster_map()
    node = next((n for n in cmap.nodes if n.data_addr == p.addr), None)
    if node is None or not node.target_ids:
        return None
    return node.target_ids[0], cmap


def _fill_once_moving(meta: list[str], p: ProcInfo, mount: Path) -> int:
    """Wait for a move onto the new node's target and its first copies,
    then fill its file system with other data (below ``min_free``): the
    copies in flight run out of room. Returns the target id."""
    def moving() -> int | None:
        got = asyncio.run(_target_of(meta, p))
        if got is None:
            return None
        tid, cmap = got
        return tid if any(tid in g.rebuilding for g in cmap.groups) else None

    tid = wait_for(moving, timeout=90, what="a move onto the new target", interval=0.1)
    # Some copies landed (nothing else is written there before the fill).
    wait_for(lambda: len(list((mount / "frags").glob("*/*/*"))) >= 2, timeout=60, interval=0.05,
             what="the first copies onto the new target")
    st = os.statvfs(mount)
    with open(mount / "other-data", "wb") as f:
        f.write(bytes(max(0, st.f_bavail * st.f_frsize - 64 * KiB)))
    return int(tid)


def _read_back(meta: list[str], files: dict[str, bytes]) -> None:
    """Every file reads back byte for byte."""
    async def check() -> None:
        async with AsyncClient(meta) as c:
            for path, data in files.items():
                assert await c.read_bytes(path) == data, path

    asyncio.run(check())


@pytest.mark.timeout(300)
def test_move_onto_a_full_target_is_named_and_drain_moves_it_elsewhere(
        cluster: tuple[LocalCluster, list[Path]]) -> None:
    cl, mounts = cluster
    meta = list(cl.meta_addrs)
    files, p = _grow_onto_tmpfs(cl, mounts, "/d", seed=0, min_free="128KiB", size="4m", storage_args=SLOW_COPY)
    _fill_once_moving(meta, p, mounts[-1])

    last: list[pb.RebalanceStatus] = []

    def stuck() -> pb.RebalanceStatus | None:
        st = asyncio.run(rebalance_status(meta))
        last[:] = [st]
        return st if st.stuck and len(st.stuck) == st.moves_in_flight else None

    try:
        st = wait_for(stuck, timeout=120, what="a move onto the full target reported stuck", interval=0.5)
    except TimeoutError:
        print(last, cli(meta, "status", ok=(0, 3)), subprocess.run(["df", str(mounts[-1])], capture_output=True,
              text=True).stdout)
        raise
    full = {m.new_target for m in st.stuck}
    assert len(full) == 1, st
    (tid,) = full
    for m in st.stuck:
        assert m.reason == f"destination target {tid} is full (read-only)", st
        assert m.old_target != tid and m.new_node, st
    text = cli(meta, "rebalance", "status")
    assert text.startswith("rebalance: stuck ("), text
    assert f"cannot go on: destination target {tid} is full (read-only)" in text, text
    node = st.stuck[0].new_node
    assert f"tierfs node drain {node}" in text, text
    assert f"destination target {tid} is full (read-only)" in cli(meta, "status", ok=(0, 3))  # 3: degraded

    # The way out the message gives: drain the full node; its members are
    # replaced and the copies go on to the replacements, from the old members.
    cli(meta, "node", "drain", str(node))

    def finished() -> bool:
        s = asyncio.run(rebalance_status(meta))
        return not s.moves_in_flight and not s.stuck

    wait_for(finished, timeout=120, what="the moves finished after the drain", interval=0.5)

    _read_back(meta, files)


@pytest.mark.timeout(300)
def test_a_target_full_when_its_node_registers_gets_no_moves(cluster: tuple[LocalCluster, list[Path]]) -> None:
    """The same cluster grows to 5 with the new node's only target on a 768
    KiB tmpfs below its ``min_free`` (1 MiB): read-only from its first
    heartbeat on. A registration carries no target state, so until this
    change the rebalancer, woken by the registration, saw the target online
    and empty and moved groups onto it before that heartbeat came: moves that
    could never finish (named stuck, above). Now the targets of a node that
    has not heartbeated since it registered are left out of the plan."""
    cl, mounts = cluster
    meta = list(cl.meta_addrs)
    files, p = _grow_onto_tmpfs(cl, mounts, "/e", seed=100, min_free="1MiB")

    async def new_target_state() -> tuple[int, int] | None:
        async with MetaClient(meta, deadline=10) as mc:
            cmap = await mc.get_cluster_map()
        node = next((n for n in cmap.nodes if n.data_addr == p.addr), None)
        if node is None or not node.target_ids:
            return None
        (tid,) = node.target_ids
        return tid, next(t.state for t in cmap.targets if t.target_id == tid)

    def read_only() -> int | None:
        got = asyncio.run(new_target_state())
        return got[0] if got is not None and got[1] == pb.TARGET_STATE_READ_ONLY else None

    tid = wait_for(read_only, timeout=60, what="the new target reported read-only", interval=0.2)
    st = asyncio.run(rebalance_status(meta))
    assert not st.stuck, st
    assert st.moves_done == 0 and st.moves_in_flight == 0, st
    assert f"target {tid} is full" not in cli(meta, "status", ok=(0, 3))

    _read_back(meta, files)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_the_leader_redirects_moves_stuck_on_a_full_target(cluster: tuple[LocalCluster, list[Path]]) -> None:
    """The same growth onto a 768 KiB tmpfs, with ``rebalance_redirect_after``
    2 s and more files written while the moves run (their fragments at a
    moving position go to the new member until it fills; then, for want of
    room, the writes of those chunks fail until the redirect). No operator
    steps in: the leader sends each move stuck on the full target on to
    another one, the moves finish, and every file reads back byte for byte,
    also with the full target's node stopped (nothing depends on the copies
    left there). Those copies are deleted by the full target's node soon
    after the redirect (group purges, gc_grace 0.5 s here), not left for a
    scrub pass an hour later."""
    cl, mounts = cluster
    meta = list(cl.meta_addrs)
    files, p = _grow_onto_tmpfs(cl, mounts, "/d", seed=200, min_free="128KiB", size="4m", storage_args=SLOW_COPY)
    tid = _fill_once_moving(meta, p, mounts[-1])
    more = {f"/d/g{i}": random_bytes(4 * CHUNK, 300 + i) for i in range(8)}

    async def write_more() -> int:
        """Writes whose chunk lands on a group moving onto the full target
        get ENOSPC (ec:2+1 stores all 3 fragments of a chunk or fails)
        until the leader redirects the move; each file is written again
        until it is stored (without the redirect: never)."""
        refused = 0
        async with AsyncClient(meta) as c:
            for path, data in more.items():
                loop = asyncio.get_running_loop()
                end = loop.time() + 60
                while True:
                    try:
                        await c.write_bytes(path, data)
                        break
                    except NoSpaceError:
                        refused += 1
                        if loop.time() > end:
                            raise
                        await asyncio.sleep(0.5)
        return refused

    refused = asyncio.run(write_more())
    print(f"writes refused for want of space before the redirect: {refused}")
    files.update(more)
    seen: list[pb.RebalanceStatus] = []

    def finished() -> bool:
        s = asyncio.run(rebalance_status(meta))
        seen.append(s)
        return s.moves_done > 0 and not s.moves_in_flight and not s.stuck and not s.moves_planned

    try:
        wait_for(finished, timeout=180, what="the moves finished with no operator", interval=0.5)
    except TimeoutError:
        print(seen[-1], cli(meta, "status", ok=(0, 3)))
        raise

    # The partial copies the redirected moves left on the full target: its
    # node deleted them (before, a scrub pass found them an hour later; this
    # cluster runs no background scrub), and meta has no purge left.
    addr = next(a.split("=", 1)[1] for a in p.argv if a.startswith("--metrics-addr="))
    wait_for(lambda: _node_event(addr, "purge_deleted") > 0, timeout=30, interval=0.3,
             what=f"the node of target {tid} to delete the copies the redirected moves left there")
    wait_for(lambda: asyncio.run(rebalance_status(meta)).purges_pending == 0, timeout=30, interval=0.3,
             what="every group purge acknowledged")
    _read_back(meta, files)
    cl.kill(p.name)
    _read_back(meta, files)


def _node_event(addr: str, event: str) -> float:
    """A storage node's ``tierfs_storage_node_events`` counter, scraped."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples
               if smp.name.startswith("tierfs_storage_node_events") and smp.labels.get("event") == event)
