"""The ops the leader's rebalancer commits (add_groups, rebalance_moves,
label_node) and the stale-map rule at commit, on the state machine."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message

from tests.meta.meta_helpers import Driver, recs
from tierfs.errors import InsufficientTargetsError, InvalidArgumentError, StaleVersionError
from tierfs.meta.rebalance import plan_top_up, top_up_input
from tierfs.proto.v1 import meta_pb2 as pb


def test_add_groups_is_refused_once_the_map_moved_and_checked() -> None:
    d = Driver()
    d.leader = False
    d.register(6, 1)
    assert not d.sm.groups  # apply plans nothing by itself
    reqs = plan_top_up(top_up_input(d.sm))
    assert reqs and all(len(g.target_ids) == 6 for g in reqs[0].groups)
    stale = pb.AddGroupsRequest()
    stale.CopyFrom(reqs[0])
    stale.map_version -= 1
    with pytest.raises(StaleVersionError):
        d.do("add_groups", stale)
    bad = pb.AddGroupsRequest(map_version=d.sm.map_version, width=6,
                              groups=[pb.GroupMembers(target_ids=[1, 1, 2, 3, 4, 5])])
    with pytest.raises(InvalidArgumentError, match="repeat"):
        d.do("add_groups", bad)
    d.do("add_groups", reqs[0])
    assert len(d.sm.groups) == 6


def test_label_and_moves() -> None:
    d = Driver()
    d.register(7, 1)
    nodes = sorted(d.sm.nodes)
    d.do("label_node", pb.LabelNodeRequest(node_id=nodes[0], rack="a"))
    assert d.sm.nodes[nodes[0]].rack == "a"
    assert d.sm.cluster_map().nodes[0].rack == "a"
    gid = min(d.sm.groups)
    members = list(d.sm.groups[gid])
    spare = next(t for t in d.sm.targets if t not in members)
    mv = pb.RebalanceMove(group_id=gid, position=0, old_target=members[0], new_target=spare, bytes=10)
    wrong = pb.RebalanceMove(group_id=gid, position=1, old_target=spare, new_target=members[0])
    reply = d.do("rebalance_moves", pb.RebalanceMovesRequest(moves=[mv, wrong]), pb.RebalanceMovesReply)
    assert reply.applied == 1 and list(reply.skipped) == [gid]
    assert d.sm.groups[gid][0] == spare and d.sm.rebuild_sources[gid] == {spare: members[0]}
    d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=gid, target_id=spare))
    assert d.sm.moves_done == 1 and d.sm.bytes_moved == 10 and not d.sm.moving


def test_commit_with_an_older_map_marks_moved_positions_missing() -> None:
    d = Driver()
    d.register(7, 1)
    d.create("/f", stripe_width=1)
    gid = d.stat("/f").layout.groups[0]
    s = d.do("open_write", pb.OpenWriteRequest(loc=pb.Loc(path="/f"), owner="t"), pb.OpenWriteReply)
    seen = d.sm.map_version
    members = list(d.sm.groups[gid])
    spare = next(t for t in d.sm.targets if t not in members)
    d.do("rebalance_moves", pb.RebalanceMovesRequest(moves=[pb.RebalanceMove(
        group_id=gid, position=2, old_target=members[2], new_target=spare)]), pb.RebalanceMovesReply)
    info = d.do("commit_write", pb.CommitWriteRequest(session_id=s.session_id, size=1 << 20,
                                                      chunks=recs(s.data_version, [0]), map_version=seen),
                pb.FileInfo)
    assert list(info.chunks[0].missing) == [2]  # the fragment went to the member before
    # A writer that knew the move: nothing missing.
    s = d.do("open_write", pb.OpenWriteRequest(loc=pb.Loc(path="/f"), owner="t"), pb.OpenWriteReply)
    info = d.do("commit_write", pb.CommitWriteRequest(session_id=s.session_id, size=1 << 20,
                                                      chunks=recs(s.data_version, [0]),
                                                      map_version=d.sm.map_version), pb.FileInfo)
    assert not info.chunks[0].missing


@pytest.mark.timeout(60)
def test_service_tops_up_groups_labels_and_reports() -> None:
    """Over a real gRPC service: a registration returns with its groups
    (planned by the servicer, committed by add_groups), a SetLayout of a new
    width can be written at once, LabelNode and GetRebalanceStatus work."""
    import asyncio

    from tests.meta.meta_helpers import meta_server

    async def main() -> None:
        async with meta_server() as (mc, svc, _):
            await svc.start()
            for i in range(6):
                rep = await mc.register_node(f"n{i}", f"h{i}", f"127.0.0.1:{9000 + i}", [("/t", 1 << 30)],
                                             rack=f"r{i % 3}")
            cmap = await mc.get_cluster_map()
            assert rep.node_id == 6 and len(cmap.groups) == 6 and {n.rack for n in cmap.nodes} == {"r0", "r1", "r2"}
            # 3 racks for width 6: up to 2 members per rack
            st = await mc.rebalance_status()
            assert st.failure_domain == "failure domain: node (only 3 racks for width 6: up to 2 fragments per rack)"
            assert st.rule_violations == 0 and st.targets == 6
            await mc.mkdir("/r")
            await mc.set_layout("/r", pb.Layout(kind=pb.REDUNDANCY_KIND_REPLICA, data_shards=1, parity_shards=2))
            assert any(g.width == 3 for g in (await mc.get_cluster_map()).groups)
            await mc.create("/r/f")  # no InsufficientTargets: the width has groups already
            await mc.label_node(1, "r9")
            assert next(n for n in (await mc.get_cluster_map()).nodes if n.node_id == 1).rack == "r9"
            st = await mc.rebalance_status()
            assert st.racks == 4 and st.rule_violations == 0, st

    asyncio.run(main())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("session_ends", [True, False])
def test_moves_wait_for_a_write_session_a_bounded_time(session_ends: bool) -> None:
    """A group an open write session has uploads in is not moved for up to
    ``write_defer`` seconds (its writer would have to re-send them); it moves
    once the session ends, or once that time is over if it never does."""
    import asyncio

    from tests.meta.meta_helpers import ups
    from tierfs.meta.rebalance import Rebalancer, groups_being_written

    d = Driver()
    d.register(7, 1)
    d.create("/f", stripe_width=1)
    gid = d.stat("/f").layout.groups[0]
    s = d.do("open_write", pb.OpenWriteRequest(loc=pb.Loc(path="/f"), owner="t"), pb.OpenWriteReply)
    assert not groups_being_written(d.sm)  # no upload yet: nothing to wait for
    d.do("renew_lease", pb.RenewLeaseRequest(session_id=s.session_id, uploads=ups(s.data_version, [0])))
    assert groups_being_written(d.sm) == {gid}
    # Two members of the session's group in one rack: the rule wants one moved.
    members = d.sm.groups[gid]
    for t in members[:2]:
        d.do("label_node", pb.LabelNodeRequest(node_id=d.sm.targets[t].node, rack="a"))
    clock = [100.0]

    async def submit(kind: str, req: object, reply_cls: type) -> object:
        assert isinstance(req, Message)
        return d.do(kind, req, reply_cls)

    rb = Rebalancer(lambda: d.sm, submit, lambda: True, max_moving=64, write_defer=10.0, clock=lambda: clock[0])

    async def rounds() -> None:
        await rb.step()
        assert gid not in d.sm.moving and rb.status().moves_planned >= 1  # planned, held
        clock[0] += 9.0
        await rb.step()
        assert gid not in d.sm.moving
        if session_ends:
            d.do("abort_write", pb.AbortWriteRequest(session_id=s.session_id))
        else:
            clock[0] += 1.0  # write_defer is over: the group moves although it is still written
        await rb.step()
        assert gid in d.sm.moving

    asyncio.run(rounds())


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("done", "ratio", "word"), [
    (True, 1.05, "rebalance: balanced"), (True, 1.28, "rebalance: idle, not balanced"), (False, 1.28, "moving"),
    # near the band's edge, three decimals (it printed "max/mean 1.10" next to "above 1.10")
    (True, 1.104, "max/mean 1.104 over 8")])
def test_status_says_balanced_only_inside_the_band(done: bool, ratio: float, word: str) -> None:
    """A new user's `rebalance status` said "balanced" at max/mean 1.28 (a
    drain since the last round): nothing planned is not balanced."""
    from tierfs.cli.rebalance import rebalance_line

    line = rebalance_line({"enabled": True, "done": done, "moves_in_flight": 0, "moves_planned": 0 if done else 2,
                           "moves_done": 3, "bytes_moved": 0, "bytes_to_move": 0, "targets": 8,
                           "balance_max_over_mean": ratio})
    assert word in line, line
    assert line.startswith("rebalance: balanced") == (word == "rebalance: balanced" or ratio <= 1.10), line


def test_failure_domain_line_speaks_of_the_groups_that_hold_data() -> None:
    """6 nodes in 3 racks, files only in a replica:3 directory: every group
    holding data is placed by rack, so status says "rack". It said "node
    (only 3 racks for width 6 ...)" of the root's default ec:4+2 groups,
    which no file used."""
    d = Driver()
    d.register(6, 1)
    for i, n in enumerate(sorted(d.sm.nodes)):
        d.do("label_node", pb.LabelNodeRequest(node_id=n, rack=f"r{i % 3}"))
    d.top_up()
    assert d.sm.failure_domain() == "failure domain: node (only 3 racks for width 6: up to 2 fragments per rack)"
    d.mkdir("/r")
    d.do("set_layout", pb.SetLayoutRequest(loc=pb.Loc(path="/r"), layout=pb.Layout(
        kind=pb.REDUNDANCY_KIND_REPLICA, data_shards=1, parity_shards=2)), pb.LayoutReply)
    d.top_up()
    d.create("/r/f")
    d.write("/r/f", 1 << 20, [0])
    assert d.sm.failure_domain() == "failure domain: rack (3 racks)"


def test_top_up_plans_again_when_its_groups_go_stale() -> None:
    """A Create of a new width races a map change (a `tierfs target rm`, a
    label, a node coming back): the leader's top-up planned the width's
    groups at version V, the map moved to V+1 before they were committed,
    and apply refused them as stale. The top-up gave up after that one
    round, so the create found no group of its width and failed with
    "layout replica:2 needs 2 online targets ..., but only 5 node(s) have
    an online target". It plans again now."""
    import asyncio

    from tierfs.meta.rebalance import Rebalancer

    d = Driver()
    d.leader = False
    d.register(5, 1)
    node = sorted(d.sm.nodes)[0]
    raced = []

    async def submit(kind: str, req: object, reply_cls: type) -> object:
        assert isinstance(req, Message)
        if kind == "add_groups" and len(raced) < 3:  # another commit lands first, three times
            raced.append(req)
            d.do("label_node", pb.LabelNodeRequest(node_id=node, rack=f"r{len(raced) % 2}"))
        return d.do(kind, req, reply_cls)

    rb = Rebalancer(lambda: d.sm, submit, lambda: True)
    done = asyncio.run(rb.top_up(2))
    assert len(raced) == 3 and done >= 1
    assert sum(len(g) == 2 for g in d.sm.groups.values()) == 5
    f = d.create("/f", kind=pb.REDUNDANCY_KIND_REPLICA, data_shards=1, parity_shards=1)
    assert f.layout.groups


def test_a_width_without_groups_is_not_blamed_on_missing_nodes() -> None:
    """Applied without the leader's groups of a new width (a top-up that
    never got them committed), a create said it "needs 2 online targets ...,
    but only 5 node(s) have an online target": a contradiction. It says no
    group of that width exists yet; too few nodes still reads as before."""
    from tierfs.meta.state import OP_FORMAT

    d = Driver()
    d.leader = False
    d.min_format = OP_FORMAT  # an entry of this release (older ones stop the replica: test_op_format)
    d.register(5, 1)
    with pytest.raises(InsufficientTargetsError) as ei:
        d.create("/f", kind=pb.REDUNDANCY_KIND_REPLICA, data_shards=1, parity_shards=1)
    msg = str(ei.value)
    assert "needs 2 online targets" in msg and "no placement group of width 2 exists yet" in msg, msg
    assert "but only 5" not in msg, msg
    with pytest.raises(InsufficientTargetsError, match="needs 6 online targets on distinct storage nodes, but only 5"):
        d.create("/g", kind=pb.REDUNDANCY_KIND_EC, data_shards=4, parity_shards=2)


@pytest.mark.timeout(60)
def test_a_round_leaves_out_targets_not_heard_from_and_a_new_leader_resumes() -> None:
    """Six nodes hold replica:2 files, a seventh registers. The round its
    registration starts leaves its target out while its node has not
    heartbeated (a target full at registration looked online and empty,
    and got moves that could never finish) and stays active; the next round
    after the heartbeat moves groups onto it. A new leader's loop starts
    active too: the leader before may have stopped part way (a round that
    left out a new node was active only there)."""
    import asyncio

    from tierfs.meta.rebalance import Rebalancer

    d = Driver()
    d.register(6, 1)
    d.mkdir("/r")
    for i in range(12):
        d.create(f"/r/f{i}", kind=pb.REDUNDANCY_KIND_REPLICA, data_shards=1, parity_shards=1)
        d.write(f"/r/f{i}", 16 << 20, [0, 1, 2, 3])
    (reg,) = d.register(1, 1, prefix="new")
    (new,) = [t.target_id for t in reg.targets]
    heard: set[int] = set()

    async def submit(kind: str, req: object, reply_cls: type) -> object:
        assert isinstance(req, Message)
        return d.do(kind, req, reply_cls)

    def onto_new() -> list[int]:
        return [g for g, (dest, _, _) in d.sm.moving.items() if dest == new]

    def unreported(sm: object) -> set[int]:
        return set() if reg.node_id in heard else {new}

    async def rounds() -> None:
        rb = Rebalancer(lambda: d.sm, submit, lambda: True, max_moving=64, unreported=unreported)
        rb.trigger()
        await rb.step()
        assert not onto_new() and not d.sm.moving  # left out: nothing moves onto it yet
        heard.add(reg.node_id)  # its first heartbeat
        await rb.step()  # still active
        assert onto_new()

    asyncio.run(rounds())
    for g in onto_new():
        d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=g, target_id=new))
    (reg2,) = d.register(1, 1, prefix="newer")
    newer = reg2.targets[0].target_id

    async def new_leader() -> None:
        # Never triggered here: the registration went to the leader before.
        rb = Rebalancer(lambda: d.sm, submit, lambda: True, max_moving=64, interval=0.01)
        rb.start()
        try:
            for _ in range(2000):
                if any(dest == newer for dest, _, _ in d.sm.moving.values()):
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"no move onto target {newer} from a new leader's rounds: {rb.status()}")
        finally:
            await rb.stop()

    asyncio.run(new_leader())


@pytest.mark.timeout(60)
def test_a_node_s_first_heartbeat_wakes_the_rebalancer_and_registration_forgets_its_usage() -> None:
    """Over a real gRPC service: a node's targets are left out of the
    rebalancer's rounds from its registration to its first heartbeat
    (``_unreported_targets``), and that heartbeat wakes the rebalancer at
    once rather than at its next interval; later heartbeats do not. A node
    that registers again (a restart) is left out again until it heartbeats."""
    import asyncio

    from tests.meta.meta_helpers import meta_server, register_async

    async def main() -> None:
        async with meta_server() as (mc, svc, _):
            regs = await register_async(mc, nodes=3, targets=1)
            rb = svc.rebalancer
            n0, t0 = regs[0].node_id, regs[0].targets[0].target_id
            assert svc._unreported_targets(svc.state) == {t.target_id for r in regs for t in r.targets}
            rb._wake.clear()
            await mc.heartbeat(n0, [pb.TargetReport(target_id=t0, used=1, capacity=1 << 40)])
            assert rb._wake.is_set()
            assert t0 not in svc._unreported_targets(svc.state)
            rb._wake.clear()
            await mc.heartbeat(n0, [pb.TargetReport(target_id=t0, used=1, capacity=1 << 40)])
            assert not rb._wake.is_set()
            await mc.register_node("node-0", "node0", "127.0.0.1:9000", [("/data/t0", 1 << 40)])
            assert t0 in svc._unreported_targets(svc.state)

    asyncio.run(main())


def _full(d: Driver, tid: int, state: int = pb.TARGET_STATE_READ_ONLY) -> None:
    node = d.sm.targets[tid].node
    d.do("heartbeat", pb.HeartbeatRequest(node_id=node, targets=[pb.TargetReport(target_id=tid, state=state)]))


@pytest.mark.parametrize("state", [pb.TARGET_STATE_READ_ONLY, pb.TARGET_STATE_FAILED])
def test_a_move_onto_a_full_member_is_redirected_and_keeps_its_copy_source(state: int) -> None:
    """redirect_moves swaps a move's new member, full (read-only) or
    failed, for another target: the newcomer inherits the move's copy
    source and the move (its bytes count once it finishes). Refused, the
    group unchanged: a member that is not a move's new member, one that is
    online again, a target that is a member already."""
    d = Driver()
    d.register(8, 1)
    d.create("/f", stripe_width=1)  # ec:4+2
    d.write("/f", 4 << 20, [0])
    gid = d.stat("/f").layout.groups[0]
    members = list(d.sm.groups[gid])
    spare, other = [t for t in sorted(d.sm.targets) if t not in members]
    d.do("rebalance_moves", pb.RebalanceMovesRequest(moves=[pb.RebalanceMove(
        group_id=gid, position=1, old_target=members[1], new_target=spare, bytes=7)]), pb.RebalanceMovesReply)

    def redirect(old: int, new: int, position: int = 1) -> pb.RebalanceMovesReply:
        return d.do("redirect_moves", pb.RebalanceMovesRequest(moves=[pb.RebalanceMove(
            group_id=gid, position=position, old_target=old, new_target=new)]), pb.RebalanceMovesReply)

    assert d.sm.redirectable_moves() == []
    r = redirect(spare, other)  # the new member is online: its copy goes on
    assert r.applied == 0 and list(r.skipped) == [gid] and d.sm.groups[gid][1] == spare
    _full(d, spare, state)
    assert d.sm.redirectable_moves() == [(gid, 1, spare)]
    v = d.sm.map_version
    assert list(redirect(members[2], other, 2).skipped) == [gid]  # not the move's member
    assert list(redirect(spare, members[3]).skipped) == [gid]  # a member already
    assert d.sm.map_version == v and d.sm.groups[gid][1] == spare
    r = redirect(spare, other)
    assert r.applied == 1 and not r.skipped
    assert d.sm.groups[gid][1] == other and d.sm.map_version == v + 1
    assert d.sm.moving[gid] == (other, members[1], 7)
    assert d.sm.rebuilding[gid] == {other} and d.sm.rebuild_sources[gid] == {other: members[1]}
    assert d.sm.redirectable_moves() == [] and d.sm.stuck_moves() == []
    d.do("finish_rebuild", pb.FinishRebuildRequest(group_id=gid, target_id=other))
    assert d.sm.moves_done == 1 and d.sm.bytes_moved == 7 and not d.sm.moving


def test_a_redirect_that_would_leave_too_few_members_is_not_made() -> None:
    """A move of a replica:2 group whose other member is down: the full new
    member may hold the only copy of what was written during the move, so
    the move is neither offered for redirect nor redirected."""
    d = Driver()
    d.register(5, 1)
    d.create("/r", kind=pb.REDUNDANCY_KIND_REPLICA, data_shards=1, parity_shards=1, stripe_width=1)
    d.write("/r", 1 << 20, [0])
    gid = d.stat("/r").layout.groups[0]
    a, b = d.sm.groups[gid]
    spare, other, *_ = [t for t in sorted(d.sm.targets) if t not in (a, b)]
    d.do("rebalance_moves", pb.RebalanceMovesRequest(moves=[pb.RebalanceMove(
        group_id=gid, position=0, old_target=a, new_target=spare)]), pb.RebalanceMovesReply)
    _full(d, spare)
    _full(d, b, pb.TARGET_STATE_FAILED)
    assert d.sm.redirect_would_lose(gid, spare) and d.sm.redirectable_moves() == []
    r = d.do("redirect_moves", pb.RebalanceMovesRequest(moves=[pb.RebalanceMove(
        group_id=gid, position=0, old_target=spare, new_target=other)]), pb.RebalanceMovesReply)
    assert r.applied == 0 and d.sm.groups[gid][0] == spare
    _full(d, b, pb.TARGET_STATE_ONLINE)
    assert d.sm.redirectable_moves() == [(gid, 0, spare)]


def _moving_onto_a_spare(d: Driver) -> tuple[int, list[int], int]:
    """8 targets, a 4 MiB ec:4+2 file, and its group's position 0 moving
    onto the lowest spare target: (group, members before, spare)."""
    d.register(8, 1)
    d.create("/f", stripe_width=1)
    d.write("/f", 4 << 20, [0])
    gid = d.stat("/f").layout.groups[0]
    members = list(d.sm.groups[gid])
    spare = min(t for t in d.sm.targets if t not in members)
    d.do("rebalance_moves", pb.RebalanceMovesRequest(moves=[pb.RebalanceMove(
        group_id=gid, position=0, old_target=members[0], new_target=spare)]), pb.RebalanceMovesReply)
    return gid, members, spare


@pytest.mark.timeout(60)
def test_the_rebalancer_redirects_a_move_stuck_on_a_full_member_after_redirect_after() -> None:
    """The leader's rounds: a move whose new member turned full is named
    with the seconds left, and once ``redirect_after`` is over the next
    round sends it on to another target; 0 turns that off."""
    import asyncio

    from tierfs.cli.rebalance import render_rebalance, status_dict
    from tierfs.meta.rebalance import Rebalancer

    d = Driver()
    gid, members, spare = _moving_onto_a_spare(d)
    _full(d, spare)
    clock = [100.0]

    async def submit(kind: str, req: object, reply_cls: type) -> object:
        assert isinstance(req, Message)
        return d.do(kind, req, reply_cls)

    async def rounds() -> None:
        off = Rebalancer(lambda: d.sm, submit, lambda: True, redirect_after=0, clock=lambda: clock[0])
        await off.step()
        (m,) = off.status().stuck
        assert not m.redirects
        rb = Rebalancer(lambda: d.sm, submit, lambda: True, redirect_after=30, clock=lambda: clock[0])
        await rb.step()
        assert d.sm.moving[gid][0] == spare
        clock[0] += 20
        (m,) = rb.status().stuck
        assert m.redirects and m.redirect_in_s == pytest.approx(10)
        text = render_rebalance(status_dict(rb.status()))
        assert "The leader sends it on to another target in 10 s; or free space on target" in text, text
        await rb.step()
        assert d.sm.moving[gid][0] == spare
        clock[0] += 10
        await rb.step()
        new = d.sm.moving[gid][0]
        assert new not in (spare, *members) and d.sm.groups[gid][0] == new
        assert d.sm.rebuild_sources[gid] == {new: members[0]}
        assert not rb.status().stuck

    asyncio.run(rounds())


@pytest.mark.timeout(60)
def test_a_new_leader_goes_on_counting_the_redirect_from_the_state() -> None:
    """The member's node reported it full at a state-clock time the
    replicas keep (``full_since``, op format 9): a leader that takes over
    25 s later redirects 5 s after, not 30 (before, every new leader
    started again, and under a leader killed every few seconds no move was
    ever redirected)."""
    import asyncio

    from tierfs.meta.rebalance import Rebalancer
    from tierfs.meta.state import FULL_SINCE_FORMAT

    d = Driver()
    d.min_format = FULL_SINCE_FORMAT
    gid, members, spare = _moving_onto_a_spare(d)
    d.advance(3)
    _full(d, spare)
    full_at = d.sm.targets[spare].full_since
    assert full_at == d.sm.clock
    d.advance(1)
    _full(d, spare, pb.TARGET_STATE_FAILED)  # still out of use: the stamp stays
    assert d.sm.targets[spare].full_since == full_at
    wall = [full_at + 25 * 10**9]

    async def submit(kind: str, req: object, reply_cls: type) -> object:
        assert isinstance(req, Message)
        return d.do(kind, req, reply_cls)

    def leader() -> Rebalancer:
        return Rebalancer(lambda: d.sm, submit, lambda: True, redirect_after=30, clock=lambda: 500.0,
                          wall_ns=lambda: wall[0])

    async def rounds() -> None:
        (m,) = leader().status().stuck
        assert m.redirects and m.redirect_in_s == pytest.approx(5)
        wall[0] += 6 * 10**9
        await leader().step()  # another new leader: due already
        assert d.sm.moving[gid][0] not in (spare, *members)

    asyncio.run(rounds())
    copy = type(d.sm)()
    copy.restore(d.sm.snapshot())
    assert copy.targets[spare].full_since == full_at
    _full(d, spare, pb.TARGET_STATE_ONLINE)
    assert d.sm.targets[spare].full_since == 0
