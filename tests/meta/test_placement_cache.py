"""A create chooses its placement groups from a per-map-version cache of
which groups have every member online (tierfs.meta.state._groups_online):
before, every create's apply walked every group of its width and every
member's state, 2 ms per create on every replica with 1,000 targets.
These tests run with the suite's fresh-computation check off, so they
test the cache itself; the rest of the suite runs with it on."""

from __future__ import annotations

import pytest

from tests.meta.meta_helpers import Driver
from tierfs.meta import state as state_mod
from tierfs.proto.v1 import meta_pb2 as pb


@pytest.fixture(autouse=True)
def _no_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_mod, "_CHECK_PLACEMENT_CACHE", False)


def _count_states(d: Driver, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = d.sm._target_state

    def counted(t: object) -> int:
        calls[0] += 1
        return real(t)  # type: ignore[arg-type]

    monkeypatch.setattr(d.sm, "_target_state", counted)
    return calls


@pytest.mark.timeout(60)
def test_creates_do_not_walk_the_groups_again_until_the_map_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Driver()
    d.register(200, 1)
    d.mkdir("/b")
    d.create("/b/first")
    calls = _count_states(d, monkeypatch)

    def create(path: str) -> pb.FileInfo:
        # The op's apply alone (Driver.create also plans group top-ups, as
        # the leader's service does, which reads every target's state).
        res = pb.MetaResult.FromString(d._apply("create", pb.CreateRequest(loc=pb.Loc(path=path))))
        assert not res.error.code, res.error.message
        return pb.FileInfo.FromString(res.reply)

    for i in range(50):
        create(f"/b/f{i}")
    assert calls[0] == 0  # before: 50 x 200 groups x 6 members
    # A map change (a target full) walks them once more, and only once.
    reg = d.sm.nodes[min(d.sm.nodes)]
    tid = reg.targets[0]
    d.do("heartbeat", pb.HeartbeatRequest(node_id=reg.id, targets=[
        pb.TargetReport(target_id=tid, state=pb.TARGET_STATE_READ_ONLY)]))
    calls[0] = 0
    infos = [create(f"/b/g{i}") for i in range(20)]
    assert 0 < calls[0] <= 2 * 200 * 6
    for info in infos:
        assert all(tid not in d.sm.groups[g] for g in info.layout.groups)  # the full member's groups left out


@pytest.mark.timeout(60)
def test_the_cache_follows_member_changes_and_failed_ops() -> None:
    """A group whose member is swapped out (a drain) and a target back
    online change the choice at once; an op that fails after it filled the
    cache leaves the state as it was, cache included."""
    d = Driver()
    regs = d.register(12, 1)
    d.mkdir("/b")
    down = regs[-1]
    tid = down.targets[0].target_id
    assert 0 < sum(tid in m for m in d.sm.groups.values()) < len(d.sm.groups)
    d.do("heartbeat", pb.HeartbeatRequest(node_id=down.node_id, targets=[
        pb.TargetReport(target_id=tid, state=pb.TARGET_STATE_READ_ONLY)]))
    with_full = {g for g, m in d.sm.groups.items() if tid in m}
    assert with_full
    chosen = set()
    for i in range(40):
        chosen |= set(d.create(f"/b/a{i}", stripe_width=1).layout.groups)
    assert not chosen & with_full
    d.do("heartbeat", pb.HeartbeatRequest(node_id=down.node_id, targets=[
        pb.TargetReport(target_id=tid, state=pb.TARGET_STATE_ONLINE)]))
    chosen = set()
    for i in range(60):
        chosen |= set(d.create(f"/b/b{i}", stripe_width=1).layout.groups)
    assert chosen & with_full  # online again: chosen again
    # The map moves again; the first create after it, which fills the
    # cache for the new version, fails after its changes: undone, cache too.
    d.do("heartbeat", pb.HeartbeatRequest(node_id=down.node_id, targets=[
        pb.TargetReport(target_id=tid, state=pb.TARGET_STATE_READ_ONLY)]))
    before = d.sm.digest(), dict(d.sm._placement), d.sm._placement_key
    assert before[2][0] != d.sm.map_version
    d.sm._fail_marker = b"fail-me"
    res = pb.MetaResult.FromString(d.raw("create", pb.CreateRequest(loc=pb.Loc(path="/b/fail-me"))))
    assert res.error.code
    assert (d.sm.digest(), dict(d.sm._placement), d.sm._placement_key) == before
    d.sm._fail_marker = b""
    assert not set(d.create("/b/ok", stripe_width=1).layout.groups) & with_full
