"""The meta state machine's failure-handling ops, in process (no daemons):
RemoveTarget, DrainNode with copy sources, RemoveNode's refusals, GC items
dropped for removed targets, and that all of it survives a snapshot."""

from __future__ import annotations

import pytest

from tests.meta.meta_helpers import Driver
from tierfs.errors import BusyError, InvalidArgumentError, NotFoundError
from tierfs.meta import MetaStateMachine
from tierfs.meta.state import GC_COPIES_FORMAT, OP_FORMAT
from tierfs.proto.v1 import meta_pb2 as pb

pytestmark = pytest.mark.timeout(30)


def _groups(d: Driver) -> dict[int, pb.PlacementGroup]:
    return {g.group_id: g for g in d.sm.cluster_map().groups}


def _same_after_restore(d: Driver) -> None:
    other = MetaStateMachine()
    other.restore(d.sm.snapshot())
    assert other.digest() == d.sm.digest()
    assert other.cluster_map() == d.sm.cluster_map()


def test_remove_target_replaces_it_everywhere_and_drops_its_gc() -> None:
    d = Driver()
    regs = d.register(7, 1)
    d.create("/f", stripe_width=7)
    d.write("/f", 7 * (4 << 20), list(range(7)))
    tid = regs[2].targets[0].target_id
    v = d.sm.cluster_map().version
    reply = d.do("remove_target", pb.RemoveTargetRequest(target_id=tid), pb.ReplaceReply)
    assert list(reply.groups_stuck) == []
    cmap = d.sm.cluster_map()
    assert cmap.version > v
    assert next(t for t in cmap.targets if t.target_id == tid).state == pb.TARGET_STATE_FAILED
    assert not any(tid in g.target_ids for g in cmap.groups)
    rebuilding = [g for g in cmap.groups if g.rebuilding]
    assert rebuilding and all(list(g.rebuild_sources) == [0] for g in rebuilding)  # dead: decode
    with pytest.raises(InvalidArgumentError, match="already removed"):
        d.do("remove_target", pb.RemoveTargetRequest(target_id=tid), pb.ReplaceReply)
    with pytest.raises(NotFoundError):
        d.do("remove_target", pb.RemoveTargetRequest(target_id=999), pb.ReplaceReply)
    # A file removed now owes GC only to live members; nothing waits on tid.
    d.do("unlink", pb.UnlinkRequest(loc=pb.Loc(path="/f")))
    assert d.sm.gc and not d.sm.list_gc([tid])
    # The removed target's node heartbeating does not bring it back.
    d.do("heartbeat", pb.HeartbeatRequest(node_id=regs[2].node_id))
    assert not any(tid in g.target_ids for g in d.sm.cluster_map().groups)
    _same_after_restore(d)


def test_drain_records_copy_sources_and_rm_waits_for_them() -> None:
    d = Driver()
    regs = d.register(7, 1)
    node = regs[4].node_id
    tid = regs[4].targets[0].target_id
    held = [g for g in _groups(d).values() if tid in g.target_ids]
    assert held
    with pytest.raises(BusyError, match="drain it first"):
        d.do("remove_node", pb.RemoveNodeRequest(node_id=node))
    reply = d.do("drain_node", pb.DrainNodeRequest(node_id=node), pb.ReplaceReply)
    assert list(reply.groups_stuck) == []
    cmap = d.sm.cluster_map()
    assert next(n for n in cmap.nodes if n.node_id == node).draining
    groups = _groups(d)
    for g in held:
        now = groups[g.group_id]
        assert tid not in now.target_ids
        assert list(now.rebuild_sources) == [tid]  # copy from the draining target
        new = now.rebuilding[0]
        assert new == now.target_ids[list(g.target_ids).index(tid)]  # same position
    _same_after_restore(d)
    # Still the copy source of unfinished rebuilds: not removable yet.
    with pytest.raises(BusyError, match="copy source"):
        d.do("remove_node", pb.RemoveNodeRequest(node_id=node))
    for g in held:
        now = groups[g.group_id]
        d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=g.group_id, target_id=now.rebuilding[0]))
    assert not any(g.rebuild_sources for g in d.sm.cluster_map().groups)
    d.do("remove_node", pb.RemoveNodeRequest(node_id=node))
    cmap = d.sm.cluster_map()
    assert node not in {n.node_id for n in cmap.nodes} and tid not in {t.target_id for t in cmap.targets}
    with pytest.raises(NotFoundError):
        d.do("remove_node", pb.RemoveNodeRequest(node_id=node))
    _same_after_restore(d)


def test_drain_without_spare_nodes_reports_stuck_groups() -> None:
    d = Driver()
    regs = d.register(6, 1)
    reply = d.do("drain_node", pb.DrainNodeRequest(node_id=regs[0].node_id), pb.ReplaceReply)
    assert sorted(reply.groups_stuck) == sorted(g.group_id for g in d.sm.cluster_map().groups
                                                if regs[0].targets[0].target_id in g.target_ids)
    assert not any(g.rebuilding for g in d.sm.cluster_map().groups)


def test_replacing_a_rebuilding_member_keeps_its_copy_source() -> None:
    # Drain node A (copy sources = A's target), then the new member dies
    # before its copy finished and is removed: its successor must still
    # copy from A's target, the only full copy of that position.
    d = Driver()
    regs = d.register(8, 1)
    a = regs[0].targets[0].target_id
    d.do("drain_node", pb.DrainNodeRequest(node_id=regs[0].node_id), pb.ReplaceReply)
    g = next(g for g in d.sm.cluster_map().groups if g.rebuilding)
    first = g.rebuilding[0]
    d.do("remove_target", pb.RemoveTargetRequest(target_id=first), pb.ReplaceReply)
    now = _groups(d)[g.group_id]
    assert first not in now.target_ids
    assert dict(zip(now.rebuilding, now.rebuild_sources, strict=True)).get(now.target_ids[list(g.target_ids).index(first)]) == a


def test_no_tick_entries_while_no_replacement_is_possible() -> None:
    # 6 nodes, ec:4+2 groups use all of them: a dead node cannot be
    # replaced, and the leader must not log a no-op tick every second for it.
    d = Driver()
    regs = d.register(6, 1)
    d.advance(20)
    for r in regs[1:]:
        d.do("heartbeat", pb.HeartbeatRequest(node_id=r.node_id))
    assert d.sm.tick_due(d.now, 5000, 1000)  # node 1 is due to go offline
    d.do("tick", pb.TickRequest(heartbeat_timeout_ms=5000, replace_after_ms=1000))
    d.advance(5)
    for r in regs[1:]:
        d.do("heartbeat", pb.HeartbeatRequest(node_id=r.node_id))
    assert not d.sm.tick_due(d.now, 5000, 1000)
    # A seventh node makes the replacement possible: now it is due.
    d.register(1, 1, prefix="spare")
    assert d.sm.tick_due(d.now, 5000, 1000)


def test_read_only_target_is_readable_but_never_placed_nor_replaced() -> None:
    # A full target (docs/storage.md, "Full disk"): its node heartbeats it
    # READ_ONLY. It stays in its groups (readable, never replaced however
    # long it lasts), but no new group, replacement or file placement picks it.
    d = Driver()
    regs = d.register(7, 1)
    full = regs[3].targets[0].target_id
    v = d.sm.cluster_map().version
    d.do("heartbeat", pb.HeartbeatRequest(node_id=regs[3].node_id, targets=[
        pb.TargetReport(target_id=full, state=pb.TARGET_STATE_READ_ONLY)]))
    cmap = d.sm.cluster_map()
    assert cmap.version > v
    assert next(t for t in cmap.targets if t.target_id == full).state == pb.TARGET_STATE_READ_ONLY
    held = {g.group_id for g in cmap.groups if full in g.target_ids}
    assert held
    for _ in range(3):
        d.advance(2.0)
        for r in regs:
            d.do("heartbeat", pb.HeartbeatRequest(node_id=r.node_id, targets=[pb.TargetReport(
                target_id=r.targets[0].target_id,
                state=pb.TARGET_STATE_READ_ONLY if r is regs[3] else pb.TARGET_STATE_ONLINE)]))
        d.do("tick", pb.TickRequest(heartbeat_timeout_ms=5000, replace_after_ms=1000))
    groups = _groups(d)
    assert {g for g, pg in groups.items() if full in pg.target_ids} == held  # not replaced
    assert not any(pg.rebuilding for pg in groups.values())
    # A new width's groups, and a file of that width, leave it out.
    d.mkdir("/n")
    d.do("set_layout", pb.SetLayoutRequest(loc=pb.Loc(path="/n"), layout=pb.Layout(
        kind=pb.REDUNDANCY_KIND_EC, data_shards=2, parity_shards=1)), pb.LayoutReply)
    narrow = [pg for pg in _groups(d).values() if len(pg.target_ids) == 3]
    assert narrow and all(full not in pg.target_ids for pg in narrow)
    info = d.create("/n/f")
    assert all(full not in _groups(d)[g].target_ids for g in info.layout.groups)
    # Groups with the full member count as degraded: new 6-wide files avoid them while others exist.
    info6 = d.create("/g6")
    healthy6 = [g for g, pg in _groups(d).items() if len(pg.target_ids) == 6 and full not in pg.target_ids]
    if healthy6:
        assert all(g in healthy6 for g in info6.layout.groups)
    # Space back: ONLINE, eligible again.
    d.do("heartbeat", pb.HeartbeatRequest(node_id=regs[3].node_id, targets=[
        pb.TargetReport(target_id=full, state=pb.TARGET_STATE_ONLINE)]))
    assert full in d.sm._eligible()
    _same_after_restore(d)


def test_undrain_lets_a_node_take_fragments_again_and_keeps_the_moves_made() -> None:
    """`tierfs node undrain` (op format 6): the flag goes, the map moves on,
    the groups the drain already moved keep their new members and their
    copy sources (those copies finish), and new groups may use the node
    again. Undrain of a node that is not draining changes nothing."""
    d = Driver()
    regs = d.register(7, 1)
    node = regs[4].node_id
    tid = regs[4].targets[0].target_id
    d.do("drain_node", pb.DrainNodeRequest(node_id=node), pb.ReplaceReply)
    moved = {g.group_id: g for g in d.sm.cluster_map().groups if g.rebuilding}
    assert moved and tid not in d.sm._eligible()
    v = d.sm.cluster_map().version
    reply = d.do("undrain_node", pb.UndrainNodeRequest(node_id=node), pb.UndrainNodeReply)
    assert reply.was_draining
    cmap = d.sm.cluster_map()
    assert cmap.version > v and not next(n for n in cmap.nodes if n.node_id == node).draining
    assert {g.group_id: g for g in cmap.groups if g.rebuilding} == moved  # the drain's copies go on
    assert tid in d.sm._eligible()
    _same_after_restore(d)
    v = cmap.version
    assert not d.do("undrain_node", pb.UndrainNodeRequest(node_id=node), pb.UndrainNodeReply).was_draining
    assert d.sm.cluster_map().version == v
    with pytest.raises(NotFoundError):
        d.do("undrain_node", pb.UndrainNodeRequest(node_id=999), pb.UndrainNodeReply)


@pytest.mark.parametrize("fmt", [OP_FORMAT, GC_COPIES_FORMAT - 1])
def test_a_finished_move_names_its_new_member_in_the_gc_items_of_its_source(fmt: int) -> None:
    """A move copies the generations waiting for GC from its source
    (tierfs.storage.repair.Repairer.copy_waiting); from op format 7 its
    FinishRebuild names the new member in those GC items, at the source's
    position, so that GC deletes the copies too (they outlived their items
    before, and scrub found them as orphans). Entries of an older leader
    leave the items as they were."""
    d = Driver()
    d.min_format = fmt
    regs = d.register(7, 1)
    d.create("/f", stripe_width=7)
    d.write("/f", 7 * (4 << 20), list(range(7)))
    d.gc_grace_ms = 300_000
    d.do("unlink", pb.UnlinkRequest(loc=pb.Loc(path="/f")))
    node, tid = regs[4].node_id, regs[4].targets[0].target_id
    mine = {e.id: e.pending[tid] for e in d.sm.gc.values() if tid in e.pending}
    assert mine
    d.do("drain_node", pb.DrainNodeRequest(node_id=node), pb.ReplaceReply)
    for g in _groups(d).values():
        if g.rebuilding:
            d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=g.group_id, target_id=g.rebuilding[0]))
    groups = _groups(d)
    for item_id, j in mine.items():
        e = d.sm.gc.get(item_id)
        assert e is not None
        new = groups[e.group].target_ids[j]
        assert new != tid
        assert (e.pending.get(new) == j) == (fmt >= GC_COPIES_FORMAT), (e, new)
        assert e.pending[tid] == j  # the source deletes its own copy still
    _same_after_restore(d)
    # The drained node goes: what it owed GC is dropped, the new members'
    # part stays.
    d.do("remove_node", pb.RemoveNodeRequest(node_id=node))
    for item_id, j in mine.items():
        e = d.sm.gc.get(item_id)
        assert e is not None and tid not in e.pending
        assert (groups[e.group].target_ids[j] in e.pending) == (fmt >= GC_COPIES_FORMAT)
    _same_after_restore(d)
