"""``tierfs kv pool create|ls|rm`` and the KV section of ``tierfs status``
against real daemons: a local cluster started by ``tierfs up``'s function
(the default pool exists once it is up), and real ``tierfs-meta`` replicas
fed heartbeats carrying KV usage (what the storage daemons report)."""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import MetaCluster, meta_cluster_from_env
from tierfs.cli import cluster_down, cluster_status, cluster_up, run
from tierfs.cli.kv import pool_ls
from tierfs.meta import MetaClient
from tierfs.proto.v1 import meta_pb2 as pb

MiB = 1 << 20


def cli(meta: str, *args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = run([*args, "--meta", meta], stdout=out, stderr=err, env={"TIERFS_TOKEN": os.environ["TIERFS_TOKEN"]}, tty=False)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data = tmp_path_factory.mktemp("kvcli") / "cluster"
    try:
        yield cluster_up(str(data), n_meta=1, n_storage=3, timeout=90)
    finally:
        if (data / "cluster.toml").exists():
            cluster_down(str(data))


@pytest.fixture
def meta(cluster: dict[str, Any]) -> str:
    return ",".join(cluster["meta"])


@pytest.mark.timeout(120)
def test_default_pool_exists_after_up(cluster: dict[str, Any], meta: str) -> None:
    rc, out, err = cli(meta, "kv", "pool", "ls", "--json")
    assert rc == 0, err
    pools = json.loads(out)
    default = next(p for p in pools if p["name"] == "default")
    assert (default["redundancy"], default["target_memory"], default["target_disk"], default["policy"]) == (
        "replica:1", 256 * MiB, 1 << 30, "lru")
    assert len(default["groups"]) == 3 and default["placement"] == "ok"  # one per target
    assert default["usage"]["objects"] == 0 and len(default["targets"]) == 3


@pytest.mark.timeout(120)
def test_create_ls_rm(meta: str) -> None:
    rc, out, err = cli(meta, "kv", "pool", "create", "hot", "--redundancy", "replica:2", "--target-memory", "64MiB",
                       "--target-disk", "1GiB", "--pin-quota", "1MiB", "--fsync", "--policy", "lru", "--json")
    assert rc == 0, err
    made = json.loads(out)
    assert (made["name"], made["redundancy"], made["width"], made["target_memory"], made["target_disk"],
            made["pin_quota"], made["fsync"]) == ("hot", "replica:2", 2, 64 * MiB, 1 << 30, MiB, True)
    assert len(made["groups"]) == 3 and all(len(g) == 2 for g in made["groups"])
    rc, out, err = cli(meta, "kv", "pool", "ls")
    assert rc == 0, err
    assert out.splitlines()[0].split()[:3] == ["KV", "POOL", "ID"]
    row = next(line for line in out.splitlines() if line.startswith("hot "))
    assert "replica:2" in row and "64.0 MiB" in row and "1.0 GiB" in row
    rc, out, err = cli(meta, "kv", "pool", "ls", "-l")
    assert rc == 0 and "  target " in out
    rc, out, err = cli(meta, "kv", "pool", "rm", "hot")
    assert rc == 0 and "KV pool 'hot' removed" in out, err
    assert "hot" not in [p["name"] for p in asyncio.run(pool_ls(meta.split(",")))]


@pytest.mark.timeout(120)
def test_pool_wider_than_the_cluster_is_made_without_groups(meta: str) -> None:
    rc, out, err = cli(meta, "kv", "pool", "create", "wide", "--redundancy", "ec:4+2", "--target-disk", "1GiB")
    assert rc == 0, err
    assert ", ec:4+2, no placement groups: needs 6 storage nodes with an online target; it takes objects" in out
    rc, out, _ = cli(meta, "kv", "pool", "ls")
    assert "pool wide: no placement groups" in out
    assert cli(meta, "kv", "pool", "rm", "wide")[0] == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("args", "code", "message"), [
    (["create", "x", "--redundancy", "raid5", "--target-memory", "1MiB"], 1, "redundancy 'raid5' is not"),
    (["create", "x", "--target-memory", "1XB"], 2, "not a size: '1XB'"),
    (["create", "x"], 1, "give a per-target memory or disk budget"),
    (["create", "x", "--target-memory", "1"], 1, "target_memory 1 bytes is below the smallest budget, 64 KiB"),
    (["create", "x", "--target-memory", "1GiB", "--target-disk", "512"], 1, "target_disk 512 bytes is below"),
    (["create", "bad/name", "--target-memory", "1MiB"], 1, "KV pool name 'bad/name'"),
    (["create", "default", "--target-memory", "1MiB"], 1, "KV pool 'default' already exists"),
    (["create", "default"], 1, "KV pool 'default' already exists"),  # not "give a ... budget"
    (["rm", "nope"], 1, "no KV pool 'nope'"),
    (["frobnicate"], 2, "invalid choice"),
    ([], 2, "the following arguments are required: ACTION"),
])
def test_errors_are_one_line_and_change_nothing(meta: str, args: list[str], code: int, message: str) -> None:
    before = asyncio.run(pool_ls(meta.split(",")))
    rc, out, err = cli(meta, "kv", "pool", *args)
    assert rc == code and message in err, (rc, out, err)
    if code == 1:
        assert err.startswith("tierfs: ") and err.count("\n") == 1
    assert asyncio.run(pool_ls(meta.split(","))) == before


@pytest.mark.timeout(120)
def test_errors_in_json(meta: str) -> None:
    rc, out, _ = cli(meta, "kv", "pool", "rm", "nope", "--json")
    assert rc == 1 and json.loads(out)["error"]["code"] == "ERROR_CODE_NOT_FOUND"


@pytest.mark.timeout(120)
def test_status_lists_pools_with_zero_usage(cluster: dict[str, Any], meta: str) -> None:
    rc, out, err = cli(meta, "status", "--json")
    assert rc == 0, err
    st = json.loads(out)
    default = next(p for p in st["kv_pools"] if p["name"] == "default")
    target_ids = sorted(t["id"] for s in st["storage"] for t in s["targets"])
    assert [t["id"] for t in default["targets"]] == target_ids
    # Nothing put yet: zeros, whether a daemon's heartbeat has reported the pool yet or not.
    assert all(t["objects"] == 0 and t["memory_used"] == 0 for t in default["targets"])
    rc, out, err = cli(meta, "status")
    assert rc == 0 and "KV POOL" in out and "default" in out and "  target " in out, err


@pytest.mark.timeout(120)
def test_status_shows_usage_per_pool_and_target(tmp_path: Path) -> None:
    """Usage reported in heartbeats (as storage daemons send it) reaches
    `tierfs status`: summed per pool, per target, zeros where unreported."""
    if meta_cluster_from_env() is not None:
        pytest.skip("registers made-up storage nodes: needs a local meta cluster")
    with MetaCluster(tmp_path, n=1, state_machine="meta") as c:
        c.wait_leader()
        addr = c.addresses[0]

        async def feed() -> tuple[list[int], int]:
            async with MetaClient([addr], deadline=10.0) as mc:
                regs = [await mc.register_node(f"n{i}", f"h{i}", f"127.0.0.1:{9100 + i}", [("/t", 1 << 30)])
                        for i in range(2)]
                pool = await mc.create_kv_pool("hot", redundancy="replica:2", target_memory=8 * MiB)
                tids = [r.targets[0].target_id for r in regs]
                await mc.heartbeat(regs[0].node_id, [pb.TargetReport(target_id=tids[0], capacity=1 << 30)],
                                   kv_usage=[pb.KVTargetUsage(pool_id=pool.pool_id, target_id=tids[0], objects=10,
                                                              memory_used=3 * MiB, disk_used=0, hits=3, misses=1,
                                                              evictions=2, puts=12)])
                return tids, pool.pool_id

        tids, _pid = asyncio.run(feed())
        st = asyncio.run(cluster_status([addr], timeout=5.0))
        hot = next(p for p in st["kv_pools"] if p["name"] == "hot")
        assert hot["usage"]["objects"] == 10 and hot["usage"]["memory_used"] == 3 * MiB
        assert hot["usage"]["hit_ratio"] == 0.75 and hot["usage"]["evictions"] == 2
        per = {t["id"]: t for t in hot["targets"]}
        assert sorted(per) == sorted(tids)
        assert per[tids[0]]["objects"] == 10 and per[tids[0]]["reported"]
        assert per[tids[1]]["objects"] == 0 and not per[tids[1]]["reported"]
        default = next(p for p in st["kv_pools"] if p["name"] == "default")
        assert default["usage"]["objects"] == 0
        rc, out, err = cli(addr, "status")
        assert rc in (0, 3), err
        line = next(s for s in out.splitlines() if s.startswith("hot "))
        assert "10" in line.split() and "3.0 MiB" in line and "75.0%" in line
