"""The ops the leader's rebalancer commits (add_groups, rebalance_moves,
label_node) and the stale-map rule at commit, on the state machine."""

from __future__ import annotations

import pytest

from tests.meta.meta_helpers import Driver, recs
from tierfs.errors import InvalidArgumentError, StaleVersionError
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
