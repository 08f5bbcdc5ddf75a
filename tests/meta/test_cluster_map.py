"""Cluster map: node/target registration, heartbeats and expiry, and the
versioned, balanced placement-group table."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from meta_helpers import Driver, gen0

from tierfs.errors import (
    InsufficientTargetsError,
    InvalidArgumentError,
    NotFoundError,
    StaleVersionError,
)
from tierfs.meta import MetaStateMachine
from tierfs.meta.placement import plan_groups
from tierfs.proto.v1 import meta_pb2 as pb

pytestmark = pytest.mark.timeout(60)


def node_of(cmap: pb.ClusterMap) -> dict[int, int]:
    return {t.target_id: t.node_id for t in cmap.targets}


def test_groups_on_distinct_nodes_and_balanced() -> None:
    d = Driver()
    regs = d.register(6, 2)
    assert [r.node_id for r in regs] == [1, 2, 3, 4, 5, 6]
    assert [t.target_id for t in regs[5].targets] == [11, 12]
    cmap = d.sm.cluster_map()
    assert len(cmap.nodes) == 6 and len(cmap.targets) == 12
    groups = [list(g.target_ids) for g in cmap.groups if g.width == 6]
    assert len(groups) == 12
    nodes = node_of(cmap)
    for g in groups:
        assert len({nodes[t] for t in g}) == 6, f"group {g} repeats a node"
    share = Counter(t for g in groups for t in g)
    assert set(share) == set(nodes) and max(share.values()) - min(share.values()) <= 1
    # each target also takes its turn at fragment 0 (read without decoding)
    firsts = Counter(g[0] for g in groups)
    assert max(firsts.values()) <= 2


def test_placement_balance_on_uneven_clusters() -> None:
    # 5 nodes with 1..3 targets, width 3: distinct nodes per group, shares within 1
    targets = {}
    tid = 1
    for node, count in enumerate([3, 1, 2, 3, 2], start=1):
        for _ in range(count):
            targets[tid] = node
            tid += 1
    groups = plan_groups(targets, [], 3, len(targets))
    assert len(groups) == len(targets)
    for g in groups:
        assert len({targets[t] for t in g}) == 3
    share = Counter(t for g in groups for t in g)
    assert max(share.values()) - min(share.values()) <= 1
    assert plan_groups(targets, [], 6, 4) == []  # only 5 nodes


def test_reregistration_keeps_ids_and_version_bumps() -> None:
    d = Driver()
    regs = d.register(6, 2)
    v = d.sm.map_version
    again = d.do("register_node", pb.RegisterNodeRequest(
        node_uuid="node-3", hostname="node3", data_addr="127.0.0.1:9003",
        targets=[pb.TargetSpec(path="/data/t1", capacity=1 << 40), pb.TargetSpec(path="/data/t0", capacity=1 << 40)]),
        pb.RegisterNodeReply)
    assert again.node_id == regs[3].node_id
    assert {t.path: t.target_id for t in again.targets} == {t.path: t.target_id for t in regs[3].targets}
    assert again.map_version == v  # nothing changed: no bump
    # a restarted node on a new address with an extra disk: same node id, one new target, version bumps
    moved = d.do("register_node", pb.RegisterNodeRequest(
        node_uuid="node-3", hostname="node3", data_addr="127.0.0.1:9999",
        targets=[pb.TargetSpec(path="/data/t0", capacity=1), pb.TargetSpec(path="/data/t1", capacity=1),
                 pb.TargetSpec(path="/data/t2", capacity=1)]), pb.RegisterNodeReply)
    assert moved.node_id == regs[3].node_id and moved.map_version > v
    assert [t.target_id for t in moved.targets][:2] == [t.target_id for t in regs[3].targets]
    assert moved.targets[2].target_id == 13
    cmap = d.sm.cluster_map()
    assert next(n for n in cmap.nodes if n.node_id == moved.node_id).data_addr == "127.0.0.1:9999"
    # the new target got groups of its own; old groups are unchanged
    assert any(13 in g.target_ids for g in cmap.groups)
    assert d.sm.cluster_map(known_version=cmap.version).unchanged
    assert not d.sm.cluster_map(known_version=cmap.version - 1).unchanged


def test_heartbeat_timeout_marks_offline_and_heartbeat_revives() -> None:
    d = Driver()
    regs = d.register(6, 2)
    v0 = d.sm.map_version
    for step in range(4):  # everyone heartbeats every 3 s, except node 2 after the start
        d.advance(3)
        for r in regs:
            if r.node_id != 2 or step == 0:
                reports = [pb.TargetReport(target_id=t.target_id, used=10 * step, capacity=1 << 40) for t in r.targets]
                hb = d.do("heartbeat", pb.HeartbeatRequest(node_id=r.node_id, targets=reports), pb.HeartbeatReply)
                assert hb.state == pb.NODE_STATE_ONLINE
        d.do("tick", pb.TickRequest(heartbeat_timeout_ms=5000))
    cmap = d.sm.cluster_map()
    states = {n.node_id: n.state for n in cmap.nodes}
    assert states[2] == pb.NODE_STATE_OFFLINE and all(s == pb.NODE_STATE_ONLINE for n, s in states.items() if n != 2)
    off = {t.target_id for t in cmap.targets if t.state == pb.TARGET_STATE_OFFLINE}
    assert off == {t.target_id for t in regs[1].targets}
    assert cmap.version > v0
    assert next(t for t in cmap.targets if t.target_id == 1).used == 30
    # no healthy ec:4+2 group any more (every group has a target on node 2): a
    # new file goes on groups that can still take a degraded write (5 of 6
    # members online = K+1); a layout that would need every member cannot.
    down = {t.target_id for t in regs[1].targets}
    degraded = d.create("/degraded")
    groups = {g.group_id: set(g.target_ids) for g in d.sm.cluster_map().groups}
    assert degraded.layout.groups and all(groups[g] & down for g in degraded.layout.groups)
    with pytest.raises(InsufficientTargetsError, match="6 online targets on distinct storage nodes"):
        d.create("/e51", kind=pb.REDUNDANCY_KIND_EC, data_shards=5, parity_shards=1)
    # node 2 comes back
    v1 = cmap.version
    hb = d.do("heartbeat", pb.HeartbeatRequest(node_id=2), pb.HeartbeatReply)
    assert hb.state == pb.NODE_STATE_ONLINE and hb.map_version > v1
    assert all(t.state == pb.TARGET_STATE_ONLINE for t in d.sm.cluster_map().targets)
    d.create("/f")
    # a daemon reporting a failed disk: that target's groups are not used for new files
    bad = regs[0].targets[0].target_id
    d.do("heartbeat", pb.HeartbeatRequest(node_id=1, targets=[pb.TargetReport(target_id=bad,
                                                                              state=pb.TARGET_STATE_FAILED)]))
    groups = {g.group_id: list(g.target_ids) for g in d.sm.cluster_map().groups}
    f = d.create("/g")
    assert all(bad not in groups[g] for g in f.layout.groups) and len(f.layout.groups) == 6


def test_insufficient_nodes_for_width() -> None:
    d = Driver()
    d.register(3, 4)
    assert d.sm.cluster_map().groups == []
    with pytest.raises(InsufficientTargetsError) as ei:
        d.create("/f")
    assert "ec:4+2" in str(ei.value) and "3 node(s)" in str(ei.value)
    before = d.sm.digest()
    assert d.sm.digest() == before
    f = d.create("/r", redundancy="replica:3")
    assert f.layout.redundancy == "replica:3" and len(f.layout.groups) == 12
    with pytest.raises(InsufficientTargetsError, match="stripe_width 20"):
        d.create("/s", redundancy="replica:3", stripe_width=20)


def test_stale_version_and_bad_heartbeats() -> None:
    d = Driver()
    d.register(6, 2)
    v = d.sm.map_version
    with pytest.raises(StaleVersionError):
        d.do("create", pb.CreateRequest(loc=pb.Loc(path="/f"), map_version=v - 1))
    d.do("create", pb.CreateRequest(loc=pb.Loc(path="/f"), map_version=v))
    with pytest.raises(StaleVersionError):
        d.do("open_write", pb.OpenWriteRequest(loc=pb.Loc(path="/f"), map_version=v - 1))
    with pytest.raises(NotFoundError, match="register"):
        d.do("heartbeat", pb.HeartbeatRequest(node_id=77))
    with pytest.raises(InvalidArgumentError, match="does not belong"):
        d.do("heartbeat", pb.HeartbeatRequest(node_id=1, targets=[pb.TargetReport(target_id=5)]))


@given(counts=st.lists(st.integers(1, 4), min_size=2, max_size=10), data=st.data())
@settings(max_examples=60, derandomize=True, deadline=None)
def test_placement_property(counts: list[int], data: st.DataObject) -> None:
    width = data.draw(st.integers(1, len(counts)))
    targets: dict[int, int] = {}
    for node, c in enumerate(counts, start=1):
        for _ in range(c):
            targets[len(targets) + 1] = node
    groups = plan_groups(targets, [], width, len(targets))
    assert len(groups) == len(targets)
    for g in groups:
        assert len({targets[t] for t in g}) == width
    if all(c * width <= len(targets) for c in counts):  # an even share is achievable
        share = Counter(t for g in groups for t in g)
        assert len(share) == len(targets) and max(share.values()) - min(share.values()) <= 1
    assert plan_groups(targets, [], width, len(targets)) == groups  # deterministic


def test_long_down_target_is_replaced_and_rebuilt() -> None:
    d = Driver()
    regs = d.register(7, 2)
    f = d.create("/f", stripe_width=14)
    d.write("/f", 14 * (4 << 20), list(range(14)))
    down = {t.target_id for t in regs[1].targets}  # node 2 stops heartbeating

    def beat_and_tick(seconds: float) -> None:
        d.advance(seconds)
        for r in regs:
            if r.node_id != 2:
                d.do("heartbeat", pb.HeartbeatRequest(node_id=r.node_id))
        d.do("tick", pb.TickRequest(heartbeat_timeout_ms=5000, replace_after_ms=60_000))

    beat_and_tick(10)
    cmap = d.sm.cluster_map()
    assert {t.target_id for t in cmap.targets if t.state == pb.TARGET_STATE_OFFLINE} == down
    assert any(down & set(g.target_ids) for g in cmap.groups)  # offline, not yet replaced
    v = cmap.version
    beat_and_tick(61)
    cmap = d.sm.cluster_map()
    assert cmap.version > v
    nodes = node_of(cmap)
    replaced = [g for g in cmap.groups if g.rebuilding]
    assert replaced and not any(down & set(g.target_ids) for g in cmap.groups)
    for g in cmap.groups:
        assert len({nodes[t] for t in g.target_ids}) == 6
    for g in replaced:
        assert len(g.rebuilding) == 1 and g.rebuilding[0] in g.target_ids
    # the repair worker learns which chunks to rebuild, then declares it done
    g = replaced[0]
    chunks = d.sm.list_group_chunks(g.group_id).chunks
    slots = [i for i, gid in enumerate(f.layout.groups) if gid == g.group_id]
    assert sorted(c.chunk for c in chunks) == sorted(c for c in range(14) if c % 14 in slots)
    assert all(c.inode == f.attr.inode and c.version == gen0(1) for c in chunks)
    snap_digest = d.sm.digest()
    restored = MetaStateMachine()
    restored.restore(d.sm.snapshot())
    assert restored.digest() == snap_digest
    d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=g.group_id, target_id=g.rebuilding[0]))
    assert not next(x for x in d.sm.cluster_map().groups if x.group_id == g.group_id).rebuilding
    with pytest.raises(InvalidArgumentError, match="not being rebuilt"):
        d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=g.group_id, target_id=g.rebuilding[0]))
    with pytest.raises(NotFoundError):
        d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=999, target_id=1))
    with pytest.raises(NotFoundError):
        d.sm.list_group_chunks(999)
    # node 2 returning does not take its old place back (its data is stale)
    d.do("heartbeat", pb.HeartbeatRequest(node_id=2))
    assert not any(down & set(x.target_ids) for x in d.sm.cluster_map().groups)


def test_no_spare_node_means_no_replacement() -> None:
    d = Driver()
    regs = d.register(6, 2)
    before = {g.group_id: list(g.target_ids) for g in d.sm.cluster_map().groups}
    d.advance(100)
    for r in regs[1:]:
        d.do("heartbeat", pb.HeartbeatRequest(node_id=r.node_id))
    d.do("tick", pb.TickRequest(heartbeat_timeout_ms=5000, replace_after_ms=1000))
    d.advance(100)
    d.do("tick", pb.TickRequest(heartbeat_timeout_ms=5000, replace_after_ms=1000))
    after = d.sm.cluster_map()
    assert {g.group_id: list(g.target_ids) for g in after.groups} == before
    assert all(not g.rebuilding for g in after.groups)
