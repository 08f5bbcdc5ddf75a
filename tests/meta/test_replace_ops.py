"""Replacements planned by the leader (tierfs.meta.replace) and sent inside
RemoveTarget, DrainNode and Tick: the same outcome as apply's own planning
(kept for old journal entries), stale or invalid replacements refused
without a trace, and at 10,000 targets apply plans nothing. KV pool re-planning (still in
apply) chooses exactly as before."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from tests.meta.meta_helpers import Driver
from tierfs.meta import MetaStateMachine
from tierfs.meta.kvpools import replan_groups
from tierfs.meta.placement import distinct_nodes, plan_groups
from tierfs.meta.replace import plan_replacements, replace_input, replacements_pb
from tierfs.proto.v1 import meta_pb2 as pb

pytestmark = pytest.mark.timeout(120)


def _twins(setup: Callable[[Driver], Any]) -> tuple[Driver, Driver]:
    a, b = Driver(), Driver()
    setup(a)
    setup(b)
    assert a.sm.digest() == b.sm.digest()
    return a, b


def _cluster(d: Driver) -> None:
    d.register(9, 2)
    d.create("/six", stripe_width=6)
    d.create("/four", stripe_width=4)
    d.write("/six", 6 * (4 << 20), list(range(6)))


def _planned(d: Driver, tids: list[int], leaving: list[int]) -> pb.Replacements:
    moves, stuck = plan_replacements(replace_input(d.sm, tids, leaving=leaving))
    return replacements_pb(moves, stuck)


def test_planned_remove_and_drain_match_the_old_in_apply_path() -> None:
    old, new = _twins(_cluster)
    tid = sorted(old.sm.targets)[3]
    rep = _planned(new, [tid], [tid])
    assert rep.moves  # the target was in groups
    r_old = old.do("remove_target", pb.RemoveTargetRequest(target_id=tid), pb.ReplaceReply)
    r_new = new.do("remove_target", pb.RemoveTargetRequest(target_id=tid, replaced=rep), pb.ReplaceReply)
    assert list(r_old.groups_stuck) == list(r_new.groups_stuck) == []
    assert old.sm.digest() == new.sm.digest()
    node = sorted(old.sm.nodes)[5]
    mine = sorted(new.sm.nodes[node].targets)
    rep = _planned(new, mine, mine)
    r_old = old.do("drain_node", pb.DrainNodeRequest(node_id=node), pb.ReplaceReply)
    r_new = new.do("drain_node", pb.DrainNodeRequest(node_id=node, replaced=rep), pb.ReplaceReply)
    assert list(r_old.groups_stuck) == list(r_new.groups_stuck)
    assert old.sm.digest() == new.sm.digest()
    assert new.sm.rebuild_sources  # drains copy from the old member
    assert not any(set(mine) & set(m) for m in new.sm.groups.values())


def test_planned_tick_matches_the_old_in_apply_path() -> None:
    def setup(d: Driver) -> None:
        _cluster(d)
        d.do("tick", pb.TickRequest(offline_nodes=[sorted(d.sm.nodes)[2]]))
        d.advance(2)

    old, new = _twins(setup)
    down = new.sm.down_for(new.now, 1000)
    assert down == sorted(new.sm.nodes[sorted(new.sm.nodes)[2]].targets)
    rep = _planned(new, down, [])
    assert rep.moves
    old.do("tick", pb.TickRequest(replace_after_ms=1000))
    new.do("tick", pb.TickRequest(replace_after_ms=1000, replaced=rep))
    assert old.sm.digest() == new.sm.digest()
    assert not any(set(down) & set(m) for m in new.sm.groups.values())
    # A planned tick with no moves replaces nothing, even with targets down.
    d = Driver()
    setup(d)
    before = {g: list(m) for g, m in d.sm.groups.items()}
    d.do("tick", pb.TickRequest(replace_after_ms=1000, replaced=pb.Replacements(planned=True)))
    assert {g: list(m) for g, m in d.sm.groups.items()} == before


def test_stale_or_invalid_replacements_are_refused_and_leave_no_trace() -> None:
    def setup(d: Driver) -> None:
        d.register(9, 1)
        nodes = sorted(d.sm.nodes)
        for i, n in enumerate(nodes):  # 8 racks (r0 holds two nodes): one rack a group at width 6
            d.do("label_node", pb.LabelNodeRequest(node_id=n, rack=f"r{i % 8}"))
        d.create("/f", stripe_width=6)

    bad, empty = _twins(setup)
    sm = bad.sm
    doms = sm.target_domains()
    node_of = {t.id: t.node for t in sm.targets.values()}

    def in_rack_of(members: list[int], tid: int) -> int | None:
        others = [m for m in members if m != tid]
        return next((t for t in sorted(sm.targets) if t not in members and doms[t] in {doms[m] for m in others}
                     and node_of[t] not in {node_of[m] for m in others}), None)

    # A member whose group has a free target in a rack the other members use.
    gid, members, tid = next((g, m, t) for g, m in sorted(sm.groups.items()) for t in m
                             if in_rack_of(m, t) is not None)
    in_rack = in_rack_of(members, tid)
    j = members.index(tid)
    others = [m for m in members if m != tid]
    spare = [t for t in sorted(sm.targets) if t not in members and t != in_rack]
    wrong = [
        (gid, j, others[0], spare[0]),  # old member is not the removed target
        (gid, (j + 1) % len(members), tid, spare[0]),  # tid is not at that position
        (gid, j, tid, others[0]),  # already a member (and on a node the group uses)
        (gid, j, tid, tid),  # the removed target itself: not eligible
        (gid + 10_000, 0, tid, spare[0]),  # no such group
    ]
    assert in_rack is not None
    wrong.append((gid, j, tid, in_rack))  # a rack the group already uses, with >= 6 racks left
    # A target that went down after the plan: no longer eligible at apply.
    bad.do("tick", pb.TickRequest(offline_nodes=[node_of[spare[-1]]]))
    empty.do("tick", pb.TickRequest(offline_nodes=[node_of[spare[-1]]]))
    wrong.append((gid, j, tid, spare[-1]))
    rep = pb.Replacements(planned=True, moves=[pb.RebalanceMove(group_id=g, position=p, old_target=o, new_target=n)
                                               for g, p, o, n in wrong])
    reply = bad.do("remove_target", pb.RemoveTargetRequest(target_id=tid, replaced=rep), pb.ReplaceReply)
    assert list(reply.groups_stuck) == [g for g, *_ in wrong]
    assert sm.groups[gid] == members  # still degraded, unchanged
    empty.do("remove_target", pb.RemoveTargetRequest(target_id=tid, replaced=pb.Replacements(planned=True)),
             pb.ReplaceReply)
    assert bad.sm.digest() == empty.sm.digest()
    # A drain's replacement naming a target of another node is refused too.
    node = node_of[others[1]]
    rep = pb.Replacements(planned=True, moves=[pb.RebalanceMove(group_id=gid, position=j, old_target=tid,
                                                                new_target=spare[0])])
    reply = bad.do("drain_node", pb.DrainNodeRequest(node_id=node, replaced=rep), pb.ReplaceReply)
    assert list(reply.groups_stuck) == [gid] and sm.groups[gid] == members


def test_10000_targets_apply_plans_nothing_and_work_is_per_move(monkeypatch: pytest.MonkeyPatch) -> None:
    nodes, per_node, width, n_groups = 100, 100, 10, 10_000
    d = Driver()
    d.leader = False
    regs = d.register(nodes, per_node)
    tids = [[t.target_id for t in r.targets] for r in regs]
    groups = [[tids[(g + 10 * k) % nodes][(g // nodes + k) % per_node] for k in range(width)]
              for g in range(n_groups)]
    for i in range(0, n_groups, 1000):
        d.do("add_groups", pb.AddGroupsRequest(map_version=d.sm.map_version, width=width,
                                               groups=[pb.GroupMembers(target_ids=g) for g in groups[i:i + 1000]]))
    assert len(d.sm.targets) == 10_000 and len(d.sm.groups) == n_groups

    def forbidden(*a: Any, **k: Any) -> Any:
        raise AssertionError("apply planned replacements itself")

    monkeypatch.setattr(MetaStateMachine, "_replace_targets", forbidden)
    monkeypatch.setattr(MetaStateMachine, "_replaceable", forbidden)
    calls = {"n": 0}
    real = MetaStateMachine._replace_member

    def counted(self: MetaStateMachine, *a: Any, **k: Any) -> None:
        calls["n"] += 1
        real(self, *a, **k)

    monkeypatch.setattr(MetaStateMachine, "_replace_member", counted)
    node = regs[17].node_id
    mine = sorted(d.sm.nodes[node].targets)
    held = sum(len(set(mine) & set(m)) for m in d.sm.groups.values())
    moves, stuck = plan_replacements(replace_input(d.sm, mine, leaving=mine))  # outside apply
    assert len(moves) == held and not stuck
    reply = d.do("drain_node", pb.DrainNodeRequest(node_id=node, replaced=replacements_pb(moves, stuck)),
                 pb.ReplaceReply)
    assert not reply.groups_stuck and calls["n"] == held
    assert not any(set(mine) & set(m) for m in d.sm.groups.values())
    # Every new member on a node its group did not use.
    node_of = {t.id: t.node for t in d.sm.targets.values()}
    assert all(len({node_of[t] for t in m}) == width for m in d.sm.groups.values())


def _replan_reference(current: list[list[int]], eligible: dict[int, int], width: int) -> list[list[int]]:
    """kvpools.replan_groups as it was (a sort of every eligible target per
    replaced member): the heap version must choose exactly the same, or old
    journals would replay to other KV pool groups."""
    if distinct_nodes(eligible) < width:
        return []
    usage: Counter[int] = Counter(t for g in current for t in g if t in eligible)
    kept: list[list[int]] = []
    for g in current:
        members = list(g)
        ok = len(members) == width
        for j, t in enumerate(members):
            if not ok:
                break
            if t in eligible:
                continue
            nodes = {eligible[m] for m in members if m in eligible}
            cands = [c for c in sorted(eligible) if eligible[c] not in nodes and c not in members]
            if not cands:
                ok = False
                break
            new = min(cands, key=lambda c: (usage[c], c))
            members[j] = new
            usage[new] += 1
        if ok:
            kept.append(members)
    want = len(eligible)
    if len(kept) > want:
        return kept[:want]
    return kept + plan_groups(eligible, kept, width, want - len(kept))


def test_kv_replan_chooses_as_before() -> None:
    rng = random.Random(7)
    for _ in range(300):
        nodes = rng.randint(2, 9)
        per = rng.randint(1, 3)
        width = rng.randint(1, min(nodes, 5))
        allt = {n * 10 + k + 1: n for n in range(nodes) for k in range(per)}
        start = [list(g) for g in plan_groups(allt, [], width, len(allt))]
        lost = set(rng.sample(sorted(allt), rng.randint(0, len(allt) // 2)))
        eligible = {t: n for t, n in allt.items() if t not in lost}
        assert replan_groups(start, eligible, width) == _replan_reference(start, eligible, width)
