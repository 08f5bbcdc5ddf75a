"""A full target, for real: storage-0's only target lives on a small tmpfs
(8 MiB, no reserve, ``min_free`` 2 MiB) and a 40 MiB ec:4+2 file is
written across the six nodes (10 MiB of fragments for each target).

What it proves: the write succeeds, degraded (the full target answers
NoSpace or is skipped once the map shows it READ_ONLY; each chunk needs
K+1 = 5 durable fragments); the file reads back byte for byte, also with
the full target's fragments in the read set; meta shows the target
``read_only`` and placement leaves it out of new groups (a new width's
groups do not use it, and a file written there does not touch it); when
the tmpfs is remounted bigger the daemon reports it ONLINE again at its
next heartbeat, and its repair-queue worker rebuilds every position the
degraded writes skipped (meta's records become whole), after which the file
still reads back with two other nodes SIGKILLed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults.harness import FaultCluster, MiB, random_bytes
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient
from tierfs.proto.v1 import meta_pb2 as pb

FULL = "storage-0"


def _mount(path: Path, size: str, *, remount: bool = False) -> None:
    opts = f"remount,size={size}" if remount else f"size={size}"
    args = ["mount", "-o", opts, str(path)] if remount else ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        raise PermissionError(r.stderr.strip() or f"mount exited {r.returncode}")


async def _state(meta: list[str]) -> tuple[dict[int, int], dict[int, list[int]]]:
    """(target -> state, group -> members)."""
    async with MetaClient(meta, deadline=10.0) as mc:
        cmap = await mc.get_cluster_map()
    return {t.target_id: t.state for t in cmap.targets}, {g.group_id: list(g.target_ids) for g in cmap.groups}


async def _missing(meta: list[str], path: str) -> list[tuple[int, ...]]:
    async with MetaClient(meta, deadline=10.0) as mc:
        return [tuple(r.missing) for r in (await mc.stat(path)).chunks]


def _wait(cond: object, what: str, timeout: float) -> float:
    t0 = time.monotonic()
    end = t0 + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, f"{what} within {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - t0


@pytest.mark.timeout(120)
def test_full_target_is_skipped_then_rejoins_and_is_repaired(tmp_path_factory: pytest.TempPathFactory) -> None:
    mnt: list[Path] = []

    def hook(cl: LocalCluster) -> None:
        p = cl.proc(FULL)
        target = Path(next(a.split("=", 1)[1] for a in p.argv if a.startswith("--target=")))
        target.mkdir(parents=True, exist_ok=True)
        try:
            _mount(target, "8m")
        except (PermissionError, OSError) as exc:
            pytest.skip(f"tmpfs mount not permitted here: {exc}")
        mnt.append(target)
        p.argv += ["--reserved-bytes=0", "--min-free=2MiB"]

    fc = FaultCluster(tmp_path_factory.mktemp("full"), plan_hook=hook,
                      extra_storage_args=("--heartbeat-interval=0.3", "--repair-interval=0.5", "--scrub-rate=0"))
    try:
        meta = fc.meta_addrs
        full_addr = fc.cl.proc(FULL).addr
        cmap = asyncio.run(_cmap(meta))
        node = next(n for n in cmap.nodes if n.data_addr == full_addr)
        tid = node.target_ids[0]
        data = random_bytes(40 * MiB, seed=7)
        with fc.client(request_timeout=2.0) as client:
            client.mkdir("/f")
            client.set_layout("/f", chunk_size=MiB, redundancy="ec:4+2")
            t0 = time.monotonic()
            client.write_bytes("/f/big", data)
            took = time.monotonic() - t0
            degraded = client.aclient.degraded_writes
            print(f"\n40 MiB written in {took:.2f} s across a full target, {degraded} chunks degraded")
            assert degraded > 0
            assert client.read_bytes("/f/big") == data

            # The daemon reports it READ_ONLY at its next heartbeat (0.3 s): the
            # write, 0.27 s in one clean-clone run, can end before that.
            _wait(lambda: asyncio.run(_state(meta))[0][tid] == pb.TARGET_STATE_READ_ONLY,
                  "the full target reported READ_ONLY", 10)
            missing = asyncio.run(_missing(meta, "/f/big"))
            skipped = sum(1 for m in missing if m)
            assert skipped == degraded, (skipped, degraded)
            assert all(len(m) <= 1 for m in missing), missing

            # Placement: a new width's groups leave the full target out, and
            # so does a file written there.
            client.mkdir("/n")
            client.set_layout("/n", chunk_size=MiB, redundancy="ec:2+1")
            small = random_bytes(3 * MiB, seed=8)
            client.write_bytes("/n/s", small)
            _, groups = asyncio.run(_state(meta))
            narrow = {g: m for g, m in groups.items() if len(m) == 3}
            assert narrow and all(tid not in m for m in narrow.values()), narrow
            used = asyncio.run(_layout_groups(meta, "/n/s"))
            assert all(tid not in groups[g] for g in used), (used, groups)
            assert client.read_bytes("/n/s") == small

        # Space returns: ONLINE at the next heartbeat, then the repair queue.
        _mount(mnt[0], "64m", remount=True)
        t_online = _wait(lambda: asyncio.run(_state(meta))[0][tid] == pb.TARGET_STATE_ONLINE,
                         "the target reported ONLINE", 10)
        t_repair = _wait(lambda: not any(asyncio.run(_missing(meta, "/f/big"))),
                         "the skipped positions repaired", 30)
        print(f"online {t_online:.2f} s after the remount, {skipped} fragments repaired {t_repair:.2f} s later")

        others = [n for n in fc.storage_names() if n != FULL][:2]
        for n in others:
            fc.cl.kill(n)
        with fc.client(request_timeout=1.0) as client:
            assert client.read_bytes("/f/big") == data
    finally:
        fc.close()
        for m in mnt:
            with contextlib.suppress(Exception):
                subprocess.run(["umount", str(m)], capture_output=True, timeout=10)


async def _cmap(meta: list[str]) -> pb.ClusterMap:
    async with MetaClient(meta, deadline=10.0) as mc:
        return await mc.get_cluster_map()


async def _layout_groups(meta: list[str], path: str) -> list[int]:
    async with MetaClient(meta, deadline=10.0) as mc:
        return list((await mc.stat(path)).layout.groups)


@pytest.mark.timeout(120)
def test_a_full_cluster_is_enospc(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every target on a 12 MiB tmpfs: a write that fills them fails with
    NoSpaceError (errno ENOSPC), and once the targets report READ_ONLY a
    new file is refused by meta with NoSpaceError naming the full targets.
    Until stop 47 the first was UnavailableError (a FUSE close said "No
    route to host") and the second "needs 6 online targets ... start or
    register more storage nodes". What was written before still reads."""
    from tierfs.errors import NoSpaceError

    mnt: list[Path] = []

    def hook(cl: LocalCluster) -> None:
        for p in cl.procs:
            if p.kind != "storage":
                continue
            target = Path(next(a.split("=", 1)[1] for a in p.argv if a.startswith("--target=")))
            target.mkdir(parents=True, exist_ok=True)
            try:
                _mount(target, "12m")
            except (PermissionError, OSError) as exc:
                pytest.skip(f"tmpfs mount not permitted here: {exc}")
            mnt.append(target)
            p.argv += ["--reserved-bytes=0", "--min-free=2MiB"]

    fc = None
    try:
        fc = FaultCluster(tmp_path_factory.mktemp("allfull"), plan_hook=hook,
                          extra_storage_args=("--heartbeat-interval=0.3", "--scrub-rate=0"))
        meta = fc.meta_addrs
        small = random_bytes(2 * MiB, seed=9)
        with fc.client(request_timeout=2.0, retries=2) as client:
            client.mkdir("/f")
            client.set_layout("/f", chunk_size=MiB, redundancy="ec:4+2")
            client.write_bytes("/f/small", small)
            with pytest.raises(NoSpaceError) as ei:
                client.write_bytes("/f/big", random_bytes(80 * MiB, seed=10))
            assert ei.value.errno == errno.ENOSPC and "its targets are full" in str(ei.value), ei.value
            _wait(lambda: all(s == pb.TARGET_STATE_READ_ONLY for s in asyncio.run(_state(meta))[0].values()),
                  "every target reported READ_ONLY", 10)
            with pytest.raises(NoSpaceError) as ei:
                client.write_bytes("/f/next", b"x" * 1000)
            assert "the cluster is full" in str(ei.value), ei.value
            assert client.read_bytes("/f/small") == small
    finally:
        if fc is not None:
            fc.close()
        for m in mnt:
            with contextlib.suppress(Exception):
                subprocess.run(["umount", str(m)], capture_output=True, timeout=10)
