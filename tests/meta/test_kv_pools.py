"""KV pool definitions in meta (docs/kv_pools.md): create/remove/list and
their validation, the pool's own placement groups re-planned with the
targets, the default pool, undo of a failing op, snapshots and determinism
(state machine op by op), then the gRPC service (usage from heartbeats) and
real ``tierfs-meta`` replicas restarted from snapshot + journal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from meta_helpers import SEC, Driver, meta_server, register_async, run

from tests.cluster import MetaCluster, meta_cluster_from_env, wait_for
from tierfs.config import load
from tierfs.errors import (
    AlreadyExistsError,
    ConfigError,
    InvalidArgumentError,
    NotFoundError,
    error_from_code,
)
from tierfs.meta import LocalReplicator, MetaClient, MetaStateMachine, add_meta_service
from tierfs.meta.config import MetaConfig
from tierfs.meta.journal import read_snapshot
from tierfs.meta.kvpools import DEFAULT_POOL_REQUEST, MAX_KV_POOLS, replan_groups
from tierfs.meta.ops import MAX_KV_BUDGET
from tierfs.meta.raft import SNAPSHOT_FILE
from tierfs.proto.v1 import meta_pb2 as pb

MiB = 1 << 20
pytestmark = pytest.mark.timeout(60)


def create(d: Driver, name: str, redundancy: str = "replica:1", **kw: Any) -> pb.KVPool:
    kw.setdefault("target_memory", 64 * MiB)
    return d.do("create_kv_pool", pb.CreateKVPoolRequest(name=name, redundancy=redundancy, **kw), pb.KVPool)


def pools(d: Driver) -> dict[str, pb.KVPool]:
    return {p.name: p for p in d.sm.cluster_map().kv_pools}


def members(p: pb.KVPool) -> list[list[int]]:
    return [list(g.target_ids) for g in p.groups]


def register_stamped(d: Driver, i: int, targets: int = 1,
                     default: pb.CreateKVPoolRequest | None = DEFAULT_POOL_REQUEST) -> None:
    """A registration as the service logs it: stamped with the leader's default pool."""
    op = pb.MetaOp(now_ns=d.now)
    op.register_node.CopyFrom(pb.RegisterNodeRequest(
        node_uuid=f"node-{i}", hostname=f"node{i}", data_addr=f"127.0.0.1:{9000 + i}",
        targets=[pb.TargetSpec(path=f"/data/t{j}", capacity=1 << 40) for j in range(targets)]))
    if default is not None:
        op.kv_default_pool.CopyFrom(default)
    data = op.SerializeToString(deterministic=True)
    d.log.append(data)
    res = pb.MetaResult.FromString(d.sm.apply(data))
    assert not res.error.code, res.error.message


# ---- definitions ------------------------------------------------------------------------


def test_create_list_remove_and_ids_never_reused() -> None:
    d = Driver()
    d.register(nodes=3, targets=2)
    v0 = d.sm.map_version
    a = create(d, "a", "replica:2", target_disk=MiB, fsync=True, pin_quota=MiB, policy="lru")
    assert (a.pool_id, a.name, a.redundancy, a.width, a.target_memory, a.target_disk, a.fsync, a.pin_quota,
            a.policy, a.created_ns) == (1, "a", "replica:2", 2, 64 * MiB, MiB, True, MiB, "lru", d.now)
    assert d.sm.map_version == v0 + 1  # clients refresh their map
    b = create(d, "b.x-Y_9", "EC:2+1")  # canonical form, defaults filled in
    assert (b.pool_id, b.redundancy, b.width, b.policy, b.target_disk) == (2, "ec:2+1", 3, "lru", 0)
    assert list(pools(d)) == ["a", "b.x-Y_9"]
    assert pools(d)["a"] == a
    d.do("remove_kv_pool", pb.RemoveKVPoolRequest(name="a"))
    assert list(pools(d)) == ["b.x-Y_9"] and d.sm.map_version == v0 + 3
    with pytest.raises(NotFoundError, match="no KV pool 'a'"):
        d.do("remove_kv_pool", pb.RemoveKVPoolRequest(name="a"))
    assert create(d, "a").pool_id == 3  # a new pool of the old name gets a new id


@pytest.mark.parametrize(("req", "message"), [
    (dict(name=""), "KV pool name ''"),
    (dict(name="a/b"), "must be 1 to 64 characters"),
    (dict(name="x" * 65), "65 characters exceed the cap of 64"),
    (dict(name="ünï"), "must be 1 to 64 characters"),
    (dict(redundancy="raid5"), "'p': redundancy 'raid5' is not 'ec:K\\+M' or 'replica:N'"),
    (dict(redundancy="replica:0"), "N must be at least 1"),
    (dict(redundancy="ec:4+0"), "M \\(parity shards\\) must be at least 1"),
    (dict(redundancy="ec:30+3"), "exceeds the maximum 32"),
    (dict(target_memory=0, target_disk=0), "give a per-target memory or disk budget"),
    (dict(target_disk=MAX_KV_BUDGET + 1), "target_disk .* exceeds the maximum"),
    (dict(pin_quota=65 * MiB), "pin_quota .* exceeds the pool's per-target budget"),
    (dict(policy="LRU!"), "policy name 'LRU!'"),
])
def test_bad_create_is_refused_and_changes_nothing(req: dict[str, Any], message: str) -> None:
    d = Driver()
    d.register(nodes=3)
    create(d, "keep")
    before, version = d.sm.digest(), d.sm.map_version
    full = {"name": "p", "redundancy": "replica:1", "target_memory": 64 * MiB, **req}
    with pytest.raises(InvalidArgumentError, match=message):
        d.do("create_kv_pool", pb.CreateKVPoolRequest(**full), pb.KVPool)
    assert d.sm.digest() == before and d.sm.map_version == version


def test_duplicate_name_and_pool_count_cap() -> None:
    d = Driver()
    d.register(nodes=1)
    create(d, "a")
    before = d.sm.digest()
    with pytest.raises(AlreadyExistsError, match="KV pool 'a' already exists"):
        create(d, "a", "replica:1", target_disk=MiB)
    assert d.sm.digest() == before
    for i in range(MAX_KV_POOLS - 1):
        create(d, f"p{i}")
    before = d.sm.digest()
    with pytest.raises(InvalidArgumentError, match=f"has {MAX_KV_POOLS} KV pools"):
        create(d, "one-too-many")
    assert d.sm.digest() == before


def test_op_failing_after_it_mutated_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test hook raises after the op changed the state: pool table,
    id counter, default flag and map version all come back."""
    monkeypatch.setenv("TIERFS_TEST_APPLY_FAIL_MARKER", "FAILHERE")
    d = Driver(MetaStateMachine())
    d.register(nodes=3)
    create(d, "a", "replica:2")
    before = d.sm.digest()
    res = pb.MetaResult.FromString(d.raw("create_kv_pool", pb.CreateKVPoolRequest(
        name="FAILHERE", target_memory=MiB)))
    assert res.error.code and "test hook" in res.error.message
    res = pb.MetaResult.FromString(d.raw("remove_kv_pool", pb.RemoveKVPoolRequest(name="FAILHERE")))
    assert res.error.code  # not there: refused before the hook
    # a registration that replans the pools and makes the default, then fails
    op = pb.MetaOp(now_ns=d.now)
    op.register_node.CopyFrom(pb.RegisterNodeRequest(node_uuid="FAILHERE", hostname="h", data_addr="127.0.0.1:1",
                                                     targets=[pb.TargetSpec(path="/t", capacity=1)]))
    op.kv_default_pool.CopyFrom(DEFAULT_POOL_REQUEST)
    res = pb.MetaResult.FromString(d.sm.apply(op.SerializeToString()))
    assert "test hook" in res.error.message
    assert d.sm.digest() == before
    assert create(d, "b").pool_id == 2


# ---- placement -----------------------------------------------------------------------------


def test_groups_wait_for_enough_nodes_then_follow_joins() -> None:
    d = Driver()
    d.register(nodes=1, targets=2)
    p = create(d, "ec", "ec:2+1")
    assert p.width == 3 and not p.groups  # created, but no groups: 1 node < width 3
    d.register(nodes=2, targets=2)
    assert not pools(d)["ec"].groups
    d.register(nodes=3, targets=2)  # node-2 joins: 3 nodes, 6 targets
    g3 = members(pools(d)["ec"])
    assert len(g3) == 6 and all(len(g) == 3 for g in g3)
    node = {t.target_id: t.node_id for t in d.sm.cluster_map().targets}
    assert all(len({node[t] for t in g}) == 3 for g in g3)  # distinct nodes
    assert [g.group_id for g in pools(d)["ec"].groups] == [1, 2, 3, 4, 5, 6]  # the pool's own id space
    d.register(nodes=4, targets=2)  # node-3 joins: existing groups kept, new ones appended
    g4 = members(pools(d)["ec"])
    assert g4[:6] == g3 and len(g4) == 8
    new = {t.target_id for t in d.sm.cluster_map().targets} - set(node)
    assert len(new) == 2 and all(new & set(g) for g in g4[6:])  # the newcomer's targets take the new groups


def test_groups_replace_removed_and_offline_targets_in_place() -> None:
    d = Driver()
    d.register(nodes=4, targets=1)
    create(d, "r2", "replica:2")
    before = members(pools(d)["r2"])
    assert len(before) == 4
    victim = before[0][0]
    d.do("remove_target", pb.RemoveTargetRequest(target_id=victim), pb.ReplaceReply)
    after = members(pools(d)["r2"])
    assert len(after) == 3 and all(victim not in g for g in after)
    for old, new in zip(before, after, strict=False):
        if victim not in old:
            assert old == new  # untouched groups keep their members and position
    # a node missing heartbeats: its target leaves the pool (a miss, not data)
    gone = after[0][1]
    gone_node = next(t.node_id for t in d.sm.cluster_map().targets if t.target_id == gone)
    d.advance(1)
    d.do("tick", pb.TickRequest(offline_nodes=[gone_node]))
    now = members(pools(d)["r2"])
    assert len(now) == 2 and all(gone not in g for g in now)
    # too few nodes left for the width: no groups at all
    d.do("tick", pb.TickRequest(offline_nodes=[n.node_id for n in d.sm.cluster_map().nodes]))
    assert not pools(d)["r2"].groups


def test_replan_is_a_pure_function() -> None:
    eligible = {1: 1, 2: 2, 3: 3, 4: 4}
    g = replan_groups([], eligible, 2)
    assert g == replan_groups([], dict(eligible), 2) and len(g) == 4
    assert replan_groups(g, eligible, 2) == g  # stable when nothing changed
    assert replan_groups(g, {1: 1}, 2) == []
    assert replan_groups([], {1: 1, 2: 1}, 2) == []  # two targets, one node


# ---- the default pool ---------------------------------------------------------------------


def test_default_pool_is_made_once_when_targets_first_register() -> None:
    d = Driver()
    assert not pools(d)
    register_stamped(d, 0)
    p = pools(d)["default"]
    assert (p.pool_id, p.redundancy, p.target_memory, p.target_disk, p.width) == (1, "replica:1", 256 * MiB,
                                                                                1 << 30, 1)
    assert members(p) == [[1]]
    register_stamped(d, 1)
    assert len(pools(d)) == 1 and members(pools(d)["default"]) == [[1], [2]]
    # removed by an operator: not made again by later registrations
    d.do("remove_kv_pool", pb.RemoveKVPoolRequest(name="default"))
    register_stamped(d, 2)
    assert not pools(d)
    # made by hand it is an ordinary pool
    assert create(d, "default", "replica:2").pool_id == 2


def test_default_pool_disabled_or_made_by_the_operator_first() -> None:
    d = Driver()
    register_stamped(d, 0, default=None)  # a leader with kv_default_pool = false
    assert not pools(d)
    d2 = Driver()
    d2.do("create_kv_pool", pb.CreateKVPoolRequest(name="default", redundancy="replica:1", target_disk=MiB),
          pb.KVPool)
    assert not pools(d2)["default"].groups  # no targets yet
    register_stamped(d2, 0, default=pb.CreateKVPoolRequest(name="default", target_memory=1))
    p = pools(d2)["default"]
    assert p.target_disk == MiB and p.target_memory == 0 and members(p) == [[1]]


def test_bad_default_pool_stamp_is_refused() -> None:
    d = Driver()
    before = d.sm.digest()
    op = pb.MetaOp(now_ns=d.now)
    op.register_node.CopyFrom(pb.RegisterNodeRequest(node_uuid="n", hostname="h", data_addr="127.0.0.1:1",
                                                     targets=[pb.TargetSpec(path="/t", capacity=1)]))
    op.kv_default_pool.CopyFrom(pb.CreateKVPoolRequest(name="default", redundancy="nope", target_memory=1))
    res = pb.MetaResult.FromString(d.sm.apply(op.SerializeToString()))
    with pytest.raises(InvalidArgumentError, match="'nope'"):
        raise error_from_code(res.error.code, res.error.message)
    assert d.sm.digest() == before


# ---- snapshots and determinism ------------------------------------------------------------


def test_snapshot_roundtrip_and_replay_are_identical() -> None:
    d = Driver()
    d.register(nodes=4, targets=2)
    create(d, "a", "replica:2")
    create(d, "b", "ec:2+1", target_disk=MiB)
    d.do("remove_kv_pool", pb.RemoveKVPoolRequest(name="a"))
    d.register(nodes=5, targets=2)
    d.advance(3)
    d.do("tick", pb.TickRequest(offline_nodes=[2]))
    snap = d.sm.snapshot()
    r = MetaStateMachine()
    r.restore(snap)
    assert r.digest() == d.sm.digest() and r.cluster_map() == d.sm.cluster_map()
    assert r.next_kv_pool == 3
    # another replica applying the same log ends in the same state
    replay = MetaStateMachine()
    for op in d.log:
        replay.apply(op)
    assert replay.digest() == d.sm.digest()
    # the restored one goes on identically
    both = [d.sm, r]
    req = pb.MetaOp(now_ns=d.now + SEC)
    req.create_kv_pool.CopyFrom(pb.CreateKVPoolRequest(name="c", target_memory=MiB))
    outs = {sm.apply(req.SerializeToString()) for sm in both}
    assert len(outs) == 1 and d.sm.digest() == r.digest()


def test_snapshot_from_before_kv_pools_loads() -> None:
    d = Driver()
    d.register(nodes=2)
    doc = json.loads(d.sm.snapshot())
    del doc["kv"]
    r = MetaStateMachine()
    r.restore(json.dumps(doc).encode())
    assert not r.kv_pools and r.next_kv_pool == 1 and not r.kv_default_done
    req = pb.MetaOp(now_ns=d.now)
    req.create_kv_pool.CopyFrom(pb.CreateKVPoolRequest(name="a", target_memory=MiB))
    res = pb.MetaResult.FromString(r.apply(req.SerializeToString()))
    assert not res.error.code and pb.KVPool.FromString(res.reply).pool_id == 1


# ---- the service: RPCs and usage from heartbeats -------------------------------------------


def _usage(pool: int, target: int, **kw: int) -> pb.KVTargetUsage:
    return pb.KVTargetUsage(pool_id=pool, target_id=target, **kw)


def test_service_pools_and_heartbeat_usage() -> None:
    async def go() -> None:
        async with meta_server() as (mc, _svc, _addr):
            regs = await register_async(mc, nodes=3, targets=1)
            listed = await mc.list_kv_pools()
            assert [p.name for p in listed.pools] == ["default"] and not listed.usage  # zeros: nothing reported
            p = await mc.create_kv_pool("hot", redundancy="replica:2", target_memory=8 * MiB)
            assert p.pool_id == 2 and len(p.groups) == 3
            with pytest.raises(AlreadyExistsError):
                await mc.create_kv_pool("hot", target_memory=MiB)
            with pytest.raises(InvalidArgumentError, match="is not 'ec:K\\+M'"):
                await mc.create_kv_pool("x", redundancy="bad", target_memory=MiB)
            # A policy of the right form that does not exist: refused by the
            # service (apply checks the form only, so journals replay alike).
            applied = (await mc.status()).applied_index
            with pytest.raises(InvalidArgumentError,
                               match="'x': unknown eviction policy 'bogus'; known: lru, leaf-lru, s3fifo"):
                await mc.create_kv_pool("x", target_memory=MiB, policy="bogus")
            assert (await mc.status()).applied_index == applied
            assert [p.name for p in (await mc.list_kv_pools()).pools] == ["default", "hot"]
            assert (await mc.create_kv_pool("y", target_memory=MiB, policy="s3fifo")).policy == "s3fifo"
            await mc.remove_kv_pool("y")
            n0, t0 = regs[0].node_id, regs[0].targets[0].target_id
            t1 = regs[1].targets[0].target_id
            applied = (await mc.status()).applied_index
            await mc.heartbeat(n0, [pb.TargetReport(target_id=t0, used=0, capacity=1 << 40)], kv_usage=[
                _usage(2, t0, objects=5, memory_used=500, hits=3, misses=1),
                _usage(1, t0, objects=1, disk_used=10),
                _usage(99, t0, objects=7),  # unknown pool: dropped, the heartbeat is not refused
                _usage(2, t1, objects=9),   # another node's target: dropped
            ])
            assert (await mc.status()).applied_index == applied  # usage alone is no log entry
            listed = await mc.list_kv_pools()
            assert [(u.pool_id, u.target_id, u.objects) for u in listed.usage] == [(1, t0, 1), (2, t0, 5)]
            assert listed.usage[1].hits == 3 and listed.usage[1].memory_used == 500
            # the next heartbeat replaces the node's report; a removed pool's usage goes
            await mc.heartbeat(n0, [pb.TargetReport(target_id=t0, used=0, capacity=1 << 40)],
                               kv_usage=[_usage(2, t0, objects=6)])
            await mc.remove_kv_pool("default")
            listed = await mc.list_kv_pools()
            assert [(u.pool_id, u.objects) for u in listed.usage] == [(2, 6)]
            with pytest.raises(NotFoundError):
                await mc.remove_kv_pool("default")
            cmap = await mc.get_cluster_map()
            assert [p.name for p in cmap.kv_pools] == ["hot"]
            # a node joins: the pool's groups grow with it, existing ones kept
            before = [list(g.target_ids) for g in cmap.kv_pools[0].groups]
            new = await mc.register_node("node-9", "node9", "127.0.0.1:9009", [("/data/t0", 1 << 40)])
            cmap = await mc.get_cluster_map()
            after = [list(g.target_ids) for g in cmap.kv_pools[0].groups]
            assert after[:3] == before and len(after) == 4 and new.targets[0].target_id in after[3]
            assert cmap.version == new.map_version

    run(go())


class RecordingReplicator(LocalReplicator):
    """A LocalReplicator that keeps every op submitted (the would-be log)."""

    def __init__(self, sm: MetaStateMachine) -> None:
        super().__init__(sm)
        self.ops: list[pb.MetaOp] = []

    async def submit(self, op: bytes, timeout: float) -> bytes:
        self.ops.append(pb.MetaOp.FromString(op))
        return await super().submit(op, timeout)


def test_logged_ops_carry_the_default_stamp_and_no_kv_usage() -> None:
    async def go() -> None:
        rep = RecordingReplicator(MetaStateMachine())
        server = grpc.aio.server()
        add_meta_service(server, rep, kv_default_pool=pb.CreateKVPoolRequest(
            name="default", redundancy="replica:1", target_disk=MiB))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with MetaClient([f"127.0.0.1:{port}"], deadline=5.0) as mc:
                reg = (await register_async(mc, nodes=1, targets=1))[0]
                tid = reg.targets[0].target_id
                # a capacity change is logged; its KV usage is not
                await mc.heartbeat(reg.node_id, [pb.TargetReport(target_id=tid, capacity=5)],
                                   kv_usage=[pb.KVTargetUsage(pool_id=1, target_id=tid, objects=3)])
                assert [u.objects for u in (await mc.list_kv_pools()).usage] == [3]
        finally:
            await server.stop(None)
        kinds = [op.WhichOneof("body") for op in rep.ops]
        # The registration made the default pool without groups; the leader
        # committed them next (tierfs.meta.kvplan), before it replied.
        assert kinds == ["register_node", "kv_groups", "heartbeat"]
        assert all(op.kv_planned for op in rep.ops)  # apply re-plans no pool for this leader's ops
        assert rep.ops[0].kv_default_pool.target_disk == MiB
        assert [(p.pool_id, p.count, [list(g.target_ids) for g in p.groups])
                for p in rep.ops[1].kv_groups.pools] == [(1, 1, [[tid]])]
        assert not rep.ops[2].HasField("kv_default_pool") and not rep.ops[2].heartbeat.kv_usage
        assert rep.ops[2].heartbeat.targets[0].capacity == 5

    run(go())


def test_default_pool_settings() -> None:
    cfg = load(MetaConfig, overrides={"insecure_no_cluster_secret": True, "kv_default_redundancy": "replica:2",
                                      "kv_default_target_memory": "1MiB", "kv_default_target_disk": "0"})
    assert cfg.kv_default_pool_request() == pb.CreateKVPoolRequest(name="default", redundancy="replica:2",
                                                                   target_memory=MiB)
    assert MetaConfig(insecure_no_cluster_secret=True).kv_default_pool_request() == DEFAULT_POOL_REQUEST
    with pytest.raises(ConfigError, match=r"kv_default_pool: .*redundancy 'raid5' is not"):
        load(MetaConfig, overrides={"kv_default_redundancy": "raid5"})
    with pytest.raises(ConfigError, match=r"kv_default_pool: .*give a per-target memory or disk budget"):
        load(MetaConfig, overrides={"kv_default_target_memory": "0", "kv_default_target_disk": "0"})
    with pytest.raises(ConfigError, match=r"kv_default_pool: .*target_memory 1 bytes is below the smallest"):
        load(MetaConfig, overrides={"kv_default_target_memory": "1"})
    # disabled: the budgets are not checked
    assert not load(MetaConfig, overrides={"kv_default_pool": "false", "kv_default_target_memory": "0",
                                           "kv_default_target_disk": "0"}).kv_default_pool


@pytest.mark.timeout(120)
def test_daemon_with_the_default_pool_disabled(tmp_path: Path) -> None:
    if meta_cluster_from_env() is not None:
        pytest.skip("starts replicas with their own flags: needs a local cluster")
    with MetaCluster(tmp_path, n=1, state_machine="meta", extra_args=["--kv-default-pool", "false"]) as c:
        c.wait_leader()

        async def go() -> list[str]:
            async with MetaClient(c.addresses, deadline=10.0) as mc:
                await register_async(mc, nodes=2, targets=1)
                return [p.name for p in (await mc.list_kv_pools()).pools]

        assert run(go()) == []


def test_service_without_default_pool() -> None:
    async def go() -> None:
        async with meta_server(kv_default_pool=None) as (mc, _svc, _addr):
            await register_async(mc, nodes=2, targets=1)
            assert not (await mc.list_kv_pools()).pools

    run(go())


# ---- real replicas: pools survive restarts ---------------------------------------------------


@pytest.mark.timeout(180)
def test_pools_survive_restart_from_snapshot_and_journal(tmp_path: Path) -> None:
    if meta_cluster_from_env() is not None:
        pytest.skip("restarts replicas: needs a local cluster")

    async def call(c: MetaCluster, fn: Any) -> Any:
        async with MetaClient(c.addresses, deadline=20.0) as mc:
            return await fn(mc)

    with MetaCluster(tmp_path, n=3, state_machine="meta", extra_args=["--snapshot-min-entries", "40"]) as c:
        c.wait_leader()
        run(call(c, lambda mc: register_async(mc, nodes=3, targets=1)))
        run(call(c, lambda mc: mc.create_kv_pool("snap", redundancy="replica:2", target_memory=MiB)))

        async def churn(mc: MetaClient) -> None:
            for i in range(25):  # 50 entries: one snapshot (at 40), not two
                await mc.create_kv_pool(f"tmp{i}", target_memory=MiB)
                await mc.remove_kv_pool(f"tmp{i}")

        run(call(c, churn))
        snaps = [r.data_dir / SNAPSHOT_FILE for r in c.replicas]
        # (generous: the child that writes a snapshot runs at nice 19 and
        # lags on a loaded host)
        wait_for(lambda: all(p.exists() for p in snaps), 90, "a snapshot on every replica")
        assert all(b'"snap"' in read_snapshot(p).state for p in snaps)
        # after the snapshot: only in the journal
        run(call(c, lambda mc: mc.create_kv_pool("journal", redundancy="ec:2+1", target_disk=MiB)))
        run(call(c, lambda mc: mc.remove_kv_pool("default")))
        before = c.wait_converged(30)
        assert all(b'"journal"' not in read_snapshot(p).state for p in snaps)
        want = run(call(c, lambda mc: mc.list_kv_pools())).pools
        assert [(p.pool_id, p.name) for p in want] == [(2, "snap"), (28, "journal")]
        for i in range(3):
            c.stop(i)
        for i in range(3):
            c.start(i)
        c.wait_leader()
        assert c.wait_converged(30) == before
        got = run(call(c, lambda mc: mc.list_kv_pools())).pools
        assert list(got) == list(want)


def test_leader_plan_keeps_a_group_whose_members_cannot_be_replaced() -> None:
    """Six nodes, a width-6 pool (ec:4+2), one node down: no target can take
    the down member's place. The first release's rule (which apply replays)
    drops every group: the pool serves nothing while the node is down. The
    leader's planner keeps the groups as they are, down member and all (the
    client reads around it, puts skip it), and plans no op for them."""
    from tierfs.meta.kvplan import KVPlanInput, plan_kv

    eligible = {t: t for t in range(1, 7)}
    g = replan_groups([], eligible, 6)
    assert len(g) == 6
    less = {t: n for t, n in eligible.items() if t != 3}
    assert replan_groups(g, less, 6) == []
    assert replan_groups(g, less, 6, keep_down=True) == g
    assert plan_kv(KVPlanInput(5, less, {1: (6, g)})) == []
    # a seventh node: the down member is replaced in place, nothing else moves
    more = {**less, 7: 7}
    new = replan_groups(g, more, 6, keep_down=True)
    assert [[7 if t == 3 else t for t in grp] for grp in g][:len(new)] == new[:len(g)]
    assert all(3 not in grp for grp in new)
