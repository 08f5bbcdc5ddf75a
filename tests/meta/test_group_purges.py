"""Group purges on the state machine: a member that leaves a position for
good (a move or drain off it finished, or it was replaced) gets its copy
deleted by its node once the GC grace is over, and may not rejoin the group
meanwhile (docs/repair.md, "Purging a former member's copy")."""

from __future__ import annotations

import asyncio

import pytest
from google.protobuf.message import Message

from tests.meta.meta_helpers import Driver
from tierfs.meta.rebalance import NO_ROOM_RECHECK, Rebalancer, move_input, plan_moves
from tierfs.meta.replace import plan_replacements, replace_input
from tierfs.meta.state import PURGE_FORMAT, MetaStateMachine
from tierfs.proto.v1 import meta_pb2 as pb

GRACE_MS = 5000


def _driver(targets: int = 8) -> Driver:
    d = Driver()
    d.min_format = PURGE_FORMAT
    d.gc_grace_ms = 10 * GRACE_MS  # purges wait for their own grace, not GC's
    d.purge_grace_ms = GRACE_MS
    d.register(targets, 1)
    d.create("/f", stripe_width=1)  # ec:4+2
    d.write("/f", 4 << 20, [0])
    return d


def _move(d: Driver, gid: int, position: int, old: int, new: int) -> pb.RebalanceMovesReply:
    return d.do("rebalance_moves", pb.RebalanceMovesRequest(moves=[pb.RebalanceMove(
        group_id=gid, position=position, old_target=old, new_target=new)]), pb.RebalanceMovesReply)


def _fill_and_redirect(d: Driver, gid: int, full: int, new: int) -> pb.RebalanceMovesReply:
    """``full``'s node reports it full; the move of position 1 onto it is
    redirected to ``new``."""
    node = d.sm.targets[full].node
    d.do("heartbeat", pb.HeartbeatRequest(node_id=node, targets=[pb.TargetReport(
        target_id=full, state=pb.TARGET_STATE_READ_ONLY)]))
    return d.do("redirect_moves", pb.RebalanceMovesRequest(moves=[pb.RebalanceMove(
        group_id=gid, position=1, old_target=full, new_target=new)]), pb.RebalanceMovesReply)


def _ack(d: Driver, purges: list[pb.GroupPurge]) -> int:
    return d.do("ack_gc", pb.AckGCRequest(purged=purges), pb.AckGCReply).purges_acked


def test_a_finished_move_purges_its_source_after_the_grace_and_bars_it_until_acknowledged() -> None:
    d = _driver()
    gid = d.stat("/f").layout.groups[0]
    members = list(d.sm.groups[gid])
    old = members[1]
    spare, other = [t for t in sorted(d.sm.targets) if t not in members]
    assert _move(d, gid, 1, old, spare).applied == 1
    assert not d.sm.purges  # the source still serves the position
    d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=gid, target_id=spare))
    version = d.sm.map_version
    assert set(d.sm.purges) == {old} and set(d.sm.purges[old]) == {(gid, 1)}
    assert d.sm.list_purges([old], now_ns=d.now) == []  # readers holding the map before may still read it
    assert d.sm.list_purges([old], now_ns=d.now + GRACE_MS * 1_000_000) == [
        pb.GroupPurge(id=1, target_id=old, group_id=gid, position=1, map_version=version)]
    assert d.sm.list_purges([other], now_ns=d.now + GRACE_MS * 1_000_000) == []

    # Barred from the group until its node has deleted the copy: neither a
    # move nor a replacement puts it back, nor do the planners choose it.
    assert d.sm.purging_in(gid, old) and not d.sm.purging_in(gid, other)
    assert (gid, old) in d.sm.barred()
    assert list(_move(d, gid, 2, members[2], old).skipped) == [gid]
    assert d.sm.groups[gid][2] == members[2]
    inp = replace_input(d.sm, [members[2]])
    moves, _ = plan_replacements(inp)
    assert moves and all(m.new != old for m in moves if m.group == gid)
    assert all((m.group, m.new) != (gid, old) for m in plan_moves(move_input(d.sm), tolerance=0.0))

    d.advance(GRACE_MS / 1000)
    listed = d.sm.list_purges([old], now_ns=d.now)
    wrong = pb.GroupPurge()
    wrong.CopyFrom(listed[0])
    wrong.id += 1
    assert _ack(d, [wrong]) == 0 and d.sm.purging_in(gid, old)  # not the purge recorded
    assert _ack(d, listed) == 1
    assert not d.sm.purges and not d.sm.purging_in(gid, old)
    assert _ack(d, listed) == 0  # a repeat changes nothing
    assert _move(d, gid, 2, members[2], old).applied == 1  # free to rejoin


def test_a_redirect_purges_the_full_member_at_once_and_the_source_when_the_copy_finishes() -> None:
    d = _driver(9)
    gid = d.stat("/f").layout.groups[0]
    members = list(d.sm.groups[gid])
    src = members[1]
    full, other, *_ = [t for t in sorted(d.sm.targets) if t not in members]
    _move(d, gid, 1, src, full)
    assert _fill_and_redirect(d, gid, full, other).applied == 1
    # The full member's partial copy goes; the source keeps serving.
    assert set(d.sm.purges) == {full} and set(d.sm.purges[full]) == {(gid, 1)}
    d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=gid, target_id=other))
    assert set(d.sm.purges) == {full, src} and set(d.sm.purges[src]) == {(gid, 1)}
    ids = sorted(v[0] for m in d.sm.purges.values() for v in m.values())
    assert ids == [1, 2] and d.sm.next_purge == 3


def test_a_drain_purges_at_the_end_of_each_copy_and_a_removed_target_none() -> None:
    d = _driver(9)
    gid = d.stat("/f").layout.groups[0]
    members = list(d.sm.groups[gid])
    drained = members[0]
    d.do("drain_node", pb.DrainNodeRequest(node_id=d.sm.targets[drained].node), pb.ReplaceReply)
    assert not d.sm.purges  # every drained member is a copy source until its copy finishes
    new = d.sm.groups[gid][0]
    d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=gid, target_id=new))
    assert (gid, 0) in d.sm.purges[drained]
    # A target declared dead will never delete anything: its purges go,
    # and its own groups' replacements record none for it.
    dead = members[3]
    d.do("remove_target", pb.RemoveTargetRequest(target_id=dead, force=True), pb.ReplaceReply)
    assert dead not in d.sm.purges
    d.do("remove_target", pb.RemoveTargetRequest(target_id=drained, force=True), pb.ReplaceReply)
    assert drained not in d.sm.purges


def test_entries_of_older_formats_record_no_purge_and_snapshots_keep_them() -> None:
    d = _driver()
    gid = d.stat("/f").layout.groups[0]
    members = list(d.sm.groups[gid])
    spare, other = [t for t in sorted(d.sm.targets) if t not in members]
    d.min_format = PURGE_FORMAT - 1
    _move(d, gid, 1, members[1], spare)
    d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=gid, target_id=spare))
    assert not d.sm.purges and d.sm.next_purge == 1
    d.min_format = PURGE_FORMAT
    _move(d, gid, 2, members[2], other)
    d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=gid, target_id=other))
    assert set(d.sm.purges) == {members[2]}
    copy = MetaStateMachine()
    copy.restore(d.sm.snapshot())
    assert copy.purges == d.sm.purges and copy.next_purge == d.sm.next_purge == 2
    assert copy.digest() == d.sm.digest()
    # Replaying the log gives the same state.
    again = MetaStateMachine()
    for entry in d.log:
        again.apply(entry)
    assert again.purges == d.sm.purges and again.digest() == d.sm.digest()
    # Acknowledged, the table is empty but the next id is kept.
    _ack(d, d.sm.list_purges([members[2]], now_ns=d.now + GRACE_MS * 1_000_000))
    copy.restore(d.sm.snapshot())
    assert not copy.purges and copy.next_purge == 2


def test_a_move_redirected_back_onto_its_source_purges_only_the_full_member() -> None:
    """The redirect may pick the move's own copy source (eligible, not a
    member): once that copy "finishes", the source holds the position
    again, and its copy must stay. (The first real run sent a move 1 -> 5
    back to 1, and the purge of target 1 reached its node, whose map check
    kept the copy.)"""
    d = _driver()
    gid = d.stat("/f").layout.groups[0]
    members = list(d.sm.groups[gid])
    src = members[1]
    full = next(t for t in sorted(d.sm.targets) if t not in members)
    _move(d, gid, 1, src, full)
    assert _fill_and_redirect(d, gid, full, src).applied == 1 and d.sm.groups[gid][1] == src
    d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=gid, target_id=src))
    assert set(d.sm.purges) == {full}



@pytest.mark.timeout(60)
def test_the_rebalancer_plans_only_moves_that_fit_the_new_member_s_free_space() -> None:
    """Placement balances bytes, not bytes over capacity: a new target with
    less free space than a group holds would get the move, fill up, have it
    redirected and purged, have room again, and be chosen again, without
    end. The rebalancer keeps only the moves that fit what the target's node
    last reported free, counting the moves in flight onto it; a round that
    kept none plans again NO_ROOM_RECHECK later."""
    d = Driver()
    d.register(6, 1)
    d.create("/f", stripe_width=6)
    d.write("/f", 24 << 20, list(range(6)))
    d.register(1, 1, prefix="late")  # a new, empty target: the rebalancer wants to move groups onto it
    new = max(d.sm.targets)
    free: dict[int, int] = {}

    async def submit(kind: str, req: object, reply_cls: type) -> object:
        assert isinstance(req, Message)
        return d.do(kind, req, reply_cls)

    async def rounds() -> None:
        now = [1000.0]
        rb = Rebalancer(lambda: d.sm, submit, lambda: True, redirect_after=0, free=lambda: free,
                        clock=lambda: now[0])
        rb.trigger()
        held = max(d.sm.gbytes.values())
        free[new] = held - 1  # less than a group holds
        await rb.step()
        assert all(mv[0] != new for mv in d.sm.moving.values())
        free[new] = 2 * held + 1  # room for two of them
        await rb.step()
        assert all(mv[0] != new for mv in d.sm.moving.values())  # idle until the recheck
        now[0] += NO_ROOM_RECHECK
        await rb.step()
        onto = [g for g, mv in d.sm.moving.items() if mv[0] == new]
        assert len(onto) == 2, d.sm.moving
        free[new] = 3 * held  # the two in flight count: still room for one more
        rb.trigger()
        await rb.step()
        assert len([g for g, mv in d.sm.moving.items() if mv[0] == new]) == 3, d.sm.moving

    asyncio.run(rounds())


@pytest.mark.parametrize(("purge", "gc", "stamped"), [(30.0, 300.0, 30_000), (30.0, 0.5, 500), (0.0, 300.0, 0)])
def test_the_leader_stamps_the_purge_grace_never_above_the_gc_grace(purge: float, gc: float, stamped: int) -> None:
    """Every op carries the leader's purge grace (so every replica computes
    the same ready times), never longer than its GC grace: a test cluster
    with a short GC grace purges as fast."""
    from tierfs.meta.interfaces import LocalReplicator
    from tierfs.meta.service import MetaServicer

    svc = MetaServicer(LocalReplicator(MetaStateMachine()), gc_grace=gc, purge_grace=purge)
    op = svc._op("mkdir", pb.MkdirRequest(loc=pb.Loc(path="/x")))
    assert op.purge_grace_ms == stamped and op.gc_grace_ms == int(gc * 1000)


def test_rebalance_status_names_the_old_copies_still_to_delete() -> None:
    """`tierfs rebalance status` says how many purges wait (and --json
    gives purges_pending); nothing when there are none."""
    from tierfs.cli.rebalance import render_rebalance, status_dict

    st = pb.RebalanceStatus(enabled=True, targets=6, balance_max_over_mean=1.0, purges_pending=3)
    r = status_dict(st)
    assert r["purges_pending"] == 3
    assert "old copies to delete: 3 group position(s)" in render_rebalance(r)
    st.purges_pending = 0
    assert "old copies" not in render_rebalance(status_dict(st))
