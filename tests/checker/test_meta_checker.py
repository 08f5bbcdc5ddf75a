"""The metadata checker (tests/checker/meta_walk.py), bounded: seeded walks
of namespace operations on three real meta replicas, with replicas killed,
stopped, restarted, the leader killed with operations in flight, all of them
crashed at once, and snapshots forced. Longer runs: ``make soak``
(tests/soak/test_meta_checker_soak.py, ``TIERFS_META_CHECKER_SEEDS``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.checker.meta_walk import MetaChecker, meta_walk_cluster, run_meta_walk
from tests.checker.walk import CheckFailed
from tests.cluster import MetaCluster, meta_cluster_from_env
from tierfs.meta import MetaClient

pytestmark = pytest.mark.timeout(600)
#: A walk with every kind of cut, an isolated leader among them (seeds 1-12 were run: docs/testing.md).
PARTITION_SEED = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetaCluster]:
    if meta_cluster_from_env() is not None:
        pytest.skip("kills replicas: needs a local cluster")
    with meta_walk_cluster(tmp_path_factory.mktemp("meta-walk") / "meta") as c:
        yield c


def test_meta_walks_lose_nothing_acknowledged(cluster: MetaCluster, tmp_path: Path) -> None:
    replaced = 0
    # Seeds whose walks replace replicas three times in all (one such walk
    # found the bug in docs/raft.md, "Membership"; its regression test is
    # tests/meta/test_raft_membership.py).
    for seed in (24, 30):
        ck = run_meta_walk(cluster, seed, 150, tmp_path / "logs")
        print(f"seed {seed}: {dict(sorted(ck.counts.items()))}")
        # Not a walk that only failed: acknowledged mutations and faults are what is checked.
        assert ck.counts.get("acked", 0) > 40, ck.counts
        assert ck.counts.get("kill", 0) + ck.counts.get("stop", 0) + ck.counts.get("storm", 0) > 3, ck.counts
        replaced += ck.counts.get("replace", 0)
    assert replaced >= 2


@pytest.mark.parametrize("change", ["unlink", "chmod", "rename"])
def test_the_checker_sees_a_change_behind_its_back(cluster: MetaCluster, change: str) -> None:
    """The checker can fail: a change it did not make (what a lost or
    reordered mutation looks like) is reported at the next check."""
    root = f"/meta-walk-behind-{change}"
    ck = MetaChecker(cluster, root)
    setup = [("mkdir", "d0"), ("create", "d0/f0", 0o644), ("symlink", "f1", "somewhere"), ("check",)]
    asyncio.run(ck.run(setup, finish=False))
    assert ck.model["d0/f0"][0] == "file" and ck.model["d0/f0"][1] > 0  # inode learnt

    async def behind() -> None:
        async with MetaClient(cluster.addresses, deadline=20) as mc:
            if change == "unlink":
                await mc.unlink(f"{root}/d0/f0")
            elif change == "chmod":
                await mc.setattr(f"{root}/d0/f0", mode=0o600)
            else:  # same name, another inode
                await mc.unlink(f"{root}/d0/f0")
                await mc.create(f"{root}/d0/f0", mode=0o644)

    asyncio.run(behind())
    with pytest.raises(CheckFailed) as err:
        asyncio.run(ck.run([("check",)], finish=False))
    assert ("[lost]" if change == "unlink" else "[wrong-state]") in str(err.value)


def test_meta_walks_with_partitions_lose_nothing_acknowledged(tmp_path: Path) -> None:
    """The same walks on replicas that each run on a host of their own
    (tests/hosts.py), with links cut as well: between two replicas, between
    a replica and the walk's client, and every link of one replica (the
    leader, mostly), which its clients still reach. Skips where network
    namespaces are not allowed."""
    if meta_cluster_from_env() is not None:
        pytest.skip("cuts links between local replicas")
    with meta_walk_cluster(tmp_path / "meta", partitions=True) as c:
        ck = run_meta_walk(c, PARTITION_SEED, 150, tmp_path / "logs")
    print(f"seed {PARTITION_SEED}: {dict(sorted(ck.counts.items()))}")
    assert ck.counts.get("acked", 0) > 40, ck.counts
    assert ck.counts.get("isolate", 0) + ck.counts.get("isolate_leader", 0) >= 1, ck.counts
    assert ck.counts.get("cuts", 0) >= 4, ck.counts
