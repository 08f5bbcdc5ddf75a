"""KV pool groups planned by the leader (tierfs.meta.kvplan) and committed as
KVGroups ops: old journal entries (without ``kv_planned``) replay through the
in-apply re-planning exactly as before, the leader's plan chooses what apply
chose, an invalid or stale plan is refused without a trace, and at 10,000
targets apply re-plans nothing."""

from __future__ import annotations

import base64
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.meta.meta_helpers import Driver
from tierfs.errors import (
    InvalidArgumentError,
    NotFoundError,
    StaleVersionError,
    TierFSError,
    error_from_code,
)
from tierfs.meta import MetaStateMachine
from tierfs.meta import state as state_mod
from tierfs.meta.kvplan import kv_plan_input, plan_kv
from tierfs.meta.kvpools import DEFAULT_POOL_REQUEST
from tierfs.meta.ops import MAX_KV_GROUP_CHANGES, MAX_OP_BYTES
from tierfs.meta.state import OP_FORMAT
from tierfs.proto.v1 import meta_pb2 as pb

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20

#: A journal written by the code before kv_planned existed (commit 98c1d5b,
#: :func:`_scenario` with ``kv_planned`` False): seven registrations stamped
#: with the default pool, three pools, a file, a node offline, a tick
#: replacing, a drain, a target removed, a label, a node back, a pool
#: removed, two nodes joining and a target failing. Every map bump in it
#: re-planned the pools inside apply.
OLD_JOURNAL = [
    "CICAqLHjn+fLFzIgCgdkZWZhdWx0EglyZXBsaWNhOjEYgICAgAEggICAgAS6AUUKBm5vZGUtMBIFbm9kZTAaDjEyNy4wLjAuMTo5MDAwKhEKCC9kYXRhL3QwEICAgICAICoRCggvZGF0YS90MRCAgICAgCA=",
    "CICUk47nn+fLFzIgCgdkZWZhdWx0EglyZXBsaWNhOjEYgICAgAEggICAgAS6AUUKBm5vZGUtMRIFbm9kZTEaDjEyNy4wLjAuMTo5MDAxKhEKCC9kYXRhL3QwEICAgICAICoRCggvZGF0YS90MRCAgICAgCA=",
    "CICo/urqn+fLFzIgCgdkZWZhdWx0EglyZXBsaWNhOjEYgICAgAEggICAgAS6AUUKBm5vZGUtMhIFbm9kZTIaDjEyNy4wLjAuMTo5MDAyKhEKCC9kYXRhL3QwEICAgICAICoRCggvZGF0YS90MRCAgICAgCA=",
    "CIC86cfun+fLFzIgCgdkZWZhdWx0EglyZXBsaWNhOjEYgICAgAEggICAgAS6AUUKBm5vZGUtMxIFbm9kZTMaDjEyNy4wLjAuMTo5MDAzKhEKCC9kYXRhL3QwEICAgICAICoRCggvZGF0YS90MRCAgICAgCA=",
    "CIDQ1KTyn+fLFzIgCgdkZWZhdWx0EglyZXBsaWNhOjEYgICAgAEggICAgAS6AUUKBm5vZGUtNBIFbm9kZTQaDjEyNy4wLjAuMTo5MDA0KhEKCC9kYXRhL3QwEICAgICAICoRCggvZGF0YS90MRCAgICAgCA=",
    "CIDkv4H2n+fLFzIgCgdkZWZhdWx0EglyZXBsaWNhOjEYgICAgAEggICAgAS6AUUKBm5vZGUtNRIFbm9kZTUaDjEyNy4wLjAuMTo5MDA1KhEKCC9kYXRhL3QwEICAgICAICoRCggvZGF0YS90MRCAgICAgCA=",
    "CIDkv4H2n+fLF+oCfAgIEAYaCAoGAQMFBwkLGggKBgIEBggKDBoICgYDAQcFCwkaCAoGBAIIBgwKGggKBgUHAQMJCxoICgYGCAIECgwaCAoGBwUDAQsJGggKBggGBAIMChoICgYJCwEDBQcaCAoGCgwCBAYIGggKBgsJAwEHBRoICgYMCgQCCAY=",
    "CID4qt75n+fLFzIgCgdkZWZhdWx0EglyZXBsaWNhOjEYgICAgAEggICAgAS6AUUKBm5vZGUtNhIFbm9kZTYaDjEyNy4wLjAuMTo5MDA2KhEKCC9kYXRhL3QwEICAgICAICoRCggvZGF0YS90MRCAgICAgCA=",
    "CID4qt75n+fLF+oCGAgKEAYaCAoGDQEJCwMHGggKBg4CDAUECA==",
    "CICMlrv9n+fLF4ICEwoCcjISCXJlcGxpY2E6MhiAgEA=",
    "CICMlrv9n+fLF4ICEAoCZWMSBmVjOjIrMRiAgEA=",
    "CICMlrv9n+fLF4ICEwoCcjMSCXJlcGxpY2E6MxiAgEA=",
    "CICMlrv9n+fLF1oMCgQKAi9mKgIoBDAB",
    "CICMlrv9n+fLF5oBCQoECgIvZhIBdA==",
    "CICMlrv9n+fLF6oBNQgBEICAgAgaCBCAgEAYgIBAGgoIARCAgEAYgIBAGgoIAhCAgEAYgIBAGgoIAxCAgEAYgIBA",
    "CICggZiBoOfLF9IBA0IBAw==",
    "CICEmeiToOfLF9IBAxDoBw==",
    "CICEmeiToOfLF+oBAggE",
    "CICEmeiToOfLF+IBAggJ",
    "CICEmeiToOfLF+ICBQgBEgFh",
    "CICYhMWXoOfLF8IBGAgDEgkIBRiAgICAgCASCQgGGICAgICAIA==",
    "CICYhMWXoOfLF4oCBAoCZWM=",
    "CICYhMWXoOfLFzIgCgdkZWZhdWx0EglyZXBsaWNhOjEYgICAgAEggICAgAS6AVgKBm5vZGUtNxIFbm9kZTcaDjEyNy4wLjAuMTo5MDA3KhEKCC9kYXRhL3QwEICAgICAICoRCggvZGF0YS90MRCAgICAgCAqEQoIL2RhdGEvdDIQgICAgIAg",
    "CICYhMWXoOfLFzIgCgdkZWZhdWx0EglyZXBsaWNhOjEYgICAgAEggICAgAS6AVgKBm5vZGUtOBIFbm9kZTgaDjEyNy4wLjAuMTo5MDA4KhEKCC9kYXRhL3QwEICAgICAICoRCggvZGF0YS90MRCAgICAgCAqEQoIL2RhdGEvdDIQgICAgIAg",
    "CICYhMWXoOfLF+oCIggYEAYaCAoGBQ0PEgEDGggKBgYQCxMCDhoICgYRBRQMBA0=",
    "CICYhMWXoOfLF8IBDwgGEgsIDBiAgICAgCAgAw==",
]
#: The digest that code reached after applying it.
OLD_DIGEST = "9d40bcb5b7cd0e7a325acde3b8eff7ccee2328d4db7e3c1c93b85c0b97e1659d"


def _register(d: Driver, i: int, targets: int = 2) -> None:
    """A registration as the service logs it (stamped with the default pool)."""
    op = pb.MetaOp(now_ns=d.now, kv_planned=d.kv_planned)
    op.register_node.CopyFrom(pb.RegisterNodeRequest(
        node_uuid=f"node-{i}", hostname=f"node{i}", data_addr=f"127.0.0.1:{9000 + i}",
        targets=[pb.TargetSpec(path=f"/data/t{j}", capacity=1 << 40) for j in range(targets)]))
    op.kv_default_pool.CopyFrom(DEFAULT_POOL_REQUEST)
    data = op.SerializeToString(deterministic=True)
    d.log.append(data)
    res = pb.MetaResult.FromString(d.sm.apply(data))
    assert not res.error.code, res.error.message
    if d.kv_planned:
        d.plan_kv()
    d.top_up()


def _scenario(d: Driver, check: Callable[[], None] = lambda: None) -> None:
    """The ops of OLD_JOURNAL (``check`` runs after each step)."""
    for i in range(7):
        _register(d, i)
        d.advance(1)
        check()
    for name, red in (("r2", "replica:2"), ("ec", "ec:2+1"), ("r3", "replica:3")):
        d.do("create_kv_pool", pb.CreateKVPoolRequest(name=name, redundancy=red, target_memory=MiB), pb.KVPool)
        check()
    d.create("/f", stripe_width=4)
    d.write("/f", 4 * (4 << 20), list(range(4)))
    nodes = sorted(d.sm.nodes)
    d.advance(1)
    d.do("tick", pb.TickRequest(offline_nodes=[nodes[2]]))
    check()
    d.advance(5)
    d.do("tick", pb.TickRequest(replace_after_ms=1000))
    check()
    d.do("drain_node", pb.DrainNodeRequest(node_id=nodes[3]), pb.ReplaceReply)
    check()
    d.do("remove_target", pb.RemoveTargetRequest(target_id=d.sm.nodes[nodes[4]].targets[0]), pb.ReplaceReply)
    check()
    d.do("label_node", pb.LabelNodeRequest(node_id=nodes[0], rack="a"))
    d.advance(1)
    t = d.sm.nodes[nodes[2]].targets
    d.do("heartbeat", pb.HeartbeatRequest(node_id=nodes[2], targets=[pb.TargetReport(target_id=x, capacity=1 << 40)
                                                                     for x in t]), pb.HeartbeatReply)
    check()
    d.do("remove_kv_pool", pb.RemoveKVPoolRequest(name="ec"))
    check()
    for i in range(7, 9):
        _register(d, i, targets=3)
        check()
    d.do("heartbeat", pb.HeartbeatRequest(node_id=nodes[5], targets=[
        pb.TargetReport(target_id=d.sm.nodes[nodes[5]].targets[1], capacity=1 << 40,
                        state=pb.TARGET_STATE_FAILED)]), pb.HeartbeatReply)
    check()


def _pools(sm: MetaStateMachine) -> dict[str, list[list[int]]]:
    return {p.name: [list(g) for g in p.groups] for p in sm.kv_pools.values()}


def _no_planning_in_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*a: Any, **k: Any) -> Any:
        raise AssertionError("apply re-planned the KV pools itself")

    monkeypatch.setattr(MetaStateMachine, "_kv_replan", forbidden)
    monkeypatch.setattr(state_mod, "replan_groups", forbidden)


def test_old_journal_replays_through_the_in_apply_path_to_the_same_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = [pb.MetaOp.FromString(base64.b64decode(x)) for x in OLD_JOURNAL]
    assert not any(op.kv_planned or op.HasField("kv_groups") for op in ops)
    calls = {"n": 0}
    real = MetaStateMachine._kv_replan

    def counted(self: MetaStateMachine) -> None:
        calls["n"] += 1
        real(self)

    monkeypatch.setattr(MetaStateMachine, "_kv_replan", counted)
    sm = MetaStateMachine()
    for raw in OLD_JOURNAL:
        assert not pb.MetaResult.FromString(sm.apply(base64.b64decode(raw))).error.code
    assert sm.digest() == OLD_DIGEST
    assert calls["n"] >= 20  # every map bump re-planned in apply
    # The scenario still writes exactly that journal with kv_planned off.
    d = Driver()
    _scenario(d)
    assert [base64.b64encode(x).decode() for x in d.log] == OLD_JOURNAL


def test_leader_plans_choose_what_apply_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = Driver(), Driver()
    new.kv_planned = True
    _scenario(old)
    seen: list[dict[str, list[list[int]]]] = []
    _scenario(new, lambda: seen.append(_pools(new.sm)))
    assert len(seen) == 19 and seen[-1] == _pools(old.sm)
    assert len(_pools(new.sm)) == 3 and all(_pools(new.sm).values())
    kinds = [pb.MetaOp.FromString(x).WhichOneof("body") for x in new.log]
    assert kinds.count("kv_groups") >= 8
    assert all(pb.MetaOp.FromString(x).kv_planned for x in new.log)
    # Step by step too: the old path, replayed op by op, passes through the
    # same pool groups at every step the new one checked.
    twin = Driver()
    twin_seen: list[dict[str, list[list[int]]]] = []
    _scenario(twin, lambda: twin_seen.append(_pools(twin.sm)))
    assert twin_seen == seen
    # The new journal replays to the same state, and never re-plans in apply.
    _no_planning_in_apply(monkeypatch)
    sm = MetaStateMachine()
    for raw in new.log:
        sm.apply(raw)
    assert sm.digest() == new.sm.digest()


def test_a_planned_op_leaves_the_pools_to_the_leader(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Driver()
    d.kv_planned = True
    d.register(4, 1)
    d.do("create_kv_pool", pb.CreateKVPoolRequest(name="r2", redundancy="replica:2", target_memory=MiB), pb.KVPool)
    before = _pools(d.sm)["r2"]
    assert len(before) == 4
    _no_planning_in_apply(monkeypatch)
    # Apply alone (no plan committed): the removed target stays in the pool.
    op = pb.MetaOp(now_ns=d.now, kv_planned=True)
    victim = before[0][0]
    op.remove_target.CopyFrom(pb.RemoveTargetRequest(target_id=victim, replaced=pb.Replacements(planned=True)))
    assert not pb.MetaResult.FromString(d.sm.apply(op.SerializeToString())).error.code
    assert _pools(d.sm)["r2"] == before
    # A pool a planned op creates has no groups until the leader's plan.
    op = pb.MetaOp(now_ns=d.now, kv_planned=True)
    op.create_kv_pool.CopyFrom(pb.CreateKVPoolRequest(name="r1", target_memory=MiB))
    assert not pb.MetaResult.FromString(d.sm.apply(op.SerializeToString())).error.code
    assert _pools(d.sm)["r1"] == []
    assert d.plan_kv() == 1
    after = _pools(d.sm)
    assert len(after["r2"]) == 3 and all(victim not in g for g in after["r2"]) and len(after["r1"]) == 3
    assert plan_kv(kv_plan_input(d.sm)) == []  # fitted: nothing more to commit


def test_large_plans_are_cut_into_ops_that_apply_in_a_row() -> None:
    d = Driver()
    d.kv_planned = True
    d.leader = False
    d.register(20, 5)
    d.kv_planned = False
    for name, red in (("r1", "replica:1"), ("r3", "replica:3"), ("ec", "ec:4+2")):
        op = pb.MetaOp(now_ns=d.now, kv_planned=True)
        op.create_kv_pool.CopyFrom(pb.CreateKVPoolRequest(name=name, redundancy=red, target_memory=MiB))
        d.sm.apply(op.SerializeToString())
    inp = kv_plan_input(d.sm)
    whole = plan_kv(inp)
    assert len(whole) == 1 and [len(p.groups) for p in whole[0].pools] == [100, 100, 100]
    cut = plan_kv(inp, max_changes=70, max_members=200)
    assert len(cut) > 4 and [r.map_version for r in cut] == list(range(inp.map_version, inp.map_version + len(cut)))
    for req in cut:
        assert sum(len(p.groups) for p in req.pools) <= 70
        assert sum(len(g.target_ids) for p in req.pools for g in p.groups) <= 200
        op = pb.MetaOp(now_ns=d.now, kv_planned=True, kv_groups=req)
        res = pb.MetaResult.FromString(d.sm.apply(op.SerializeToString()))
        assert not res.error.code, res.error.message
    assert plan_kv(kv_plan_input(d.sm)) == []
    # The pools hold what one op would have given (planned on the way).
    assert all(len(g) == 100 for g in _pools(d.sm).values())
    # The largest plan the caps allow fits one op.
    assert whole[0].ByteSize() < MAX_OP_BYTES


def _bad_cases(sm: MetaStateMachine) -> list[tuple[str, pb.KVGroupsRequest, type[TierFSError], str]]:
    v = sm.map_version
    pools = {p.name: p for p in sm.kv_pools.values()}
    r2, r3 = pools["r2"], pools["r3"]
    node_of = {t.id: t.node for t in sm.targets.values()}
    eligible = sm.eligible_targets()
    down = next(t for t in sorted(sm.targets) if t not in eligible)
    g0 = list(r3.groups[0])
    same_node = next(t for t in sorted(eligible) if node_of[t] == node_of[g0[1]] and t != g0[1])
    free = [t for t in sorted(eligible) if node_of[t] not in {node_of[m] for m in g0}]

    def req(pid: int, count: int, changes: list[tuple[int, list[int]]], version: int = v) -> pb.KVGroupsRequest:
        return pb.KVGroupsRequest(map_version=version, pools=[pb.KVPoolGroups(
            pool_id=pid, count=count, groups=[pb.KVGroupChange(index=i, target_ids=m) for i, m in changes])])

    n3 = len(r3.groups)
    return [
        ("stale", req(r3.id, n3, [(0, [free[0], g0[1], g0[2]])], v - 1), StaleVersionError, "map version"),
        ("no-pool", req(99, 1, [(0, [free[0]])]), NotFoundError, "no KV pool 99"),
        ("width", req(r3.id, n3, [(0, [free[0], g0[1]])]), InvalidArgumentError, "not 3"),
        ("repeat", req(r3.id, n3, [(0, [g0[1], g0[1], g0[2]])]), InvalidArgumentError, "repeat"),
        ("not-eligible", req(r3.id, n3, [(0, [down, g0[1], g0[2]])]), InvalidArgumentError, "not eligible"),
        ("same-node", req(r3.id, n3, [(0, [same_node, g0[1], g0[2]])]), InvalidArgumentError, "share a node"),
        ("unknown-target", req(r3.id, n3, [(0, [10_000, g0[1], g0[2]])]), InvalidArgumentError, "not eligible"),
        ("too-many", req(r2.id, len(eligible) + 1, [(i, [free[0], free[1]]) for i in
                                                    range(len(r2.groups), len(eligible) + 1)]),
         InvalidArgumentError, "exceed one per eligible target"),
        ("gap", req(r3.id, n3 + 2, [(n3 + 1, [free[0], free[1], free[2]])]), InvalidArgumentError,
         "new group(s) are given"),
        ("past-count", req(r3.id, 1, [(1, g0)]), InvalidArgumentError, "past the pool's 1 groups"),
        ("order", pb.KVGroupsRequest(map_version=v, pools=[
            pb.KVPoolGroups(pool_id=r3.id, count=n3), pb.KVPoolGroups(pool_id=r2.id, count=1)]),
         InvalidArgumentError, "not after pool"),
        ("index-order", req(r3.id, n3, [(1, g0), (0, g0)]), InvalidArgumentError, "group index 0 is not after 1"),
        ("empty-group", req(r3.id, n3, [(0, [])]), InvalidArgumentError, "no members"),
        ("cap", req(r3.id, MAX_KV_GROUP_CHANGES + 1, [(i, [1]) for i in range(MAX_KV_GROUP_CHANGES + 1)]),
         InvalidArgumentError, "kv_groups.pools[0].groups"),
        # one good group and one bad: nothing of it is applied
        ("half-good", req(r3.id, n3, [(0, [free[0], g0[1], g0[2]]), (1, [down, *r3.groups[1][1:]])]),
         InvalidArgumentError, "not eligible"),
    ]


CASES = ["stale", "no-pool", "width", "repeat", "not-eligible", "same-node", "unknown-target", "too-many", "gap",
         "past-count", "order", "index-order", "empty-group", "cap", "half-good"]


@pytest.mark.parametrize("case", CASES)
def test_invalid_or_stale_plans_are_refused_and_change_nothing(case: str) -> None:
    d = Driver()
    d.kv_planned = True
    d.register(6, 2)
    for name, red in (("r2", "replica:2"), ("r3", "replica:3")):
        d.do("create_kv_pool", pb.CreateKVPoolRequest(name=name, redundancy=red, target_memory=MiB), pb.KVPool)
    d.do("tick", pb.TickRequest(offline_nodes=[sorted(d.sm.nodes)[5]]))
    cases = {c[0]: c[1:] for c in _bad_cases(d.sm)}
    assert sorted(cases) == sorted(CASES)
    req, exc, words = cases[case]
    before = d.sm.digest()
    res = pb.MetaResult.FromString(d.sm.apply(pb.MetaOp(now_ns=d.now, kv_planned=True,
                                                        kv_groups=req).SerializeToString()))
    err = error_from_code(res.error.code, res.error.message)
    assert type(err) is exc and words in err.message, f"{type(err).__name__}: {err}"
    assert d.sm.digest() == before


def test_10000_targets_apply_replans_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three pools over 100 nodes x 100 targets; a node drained. Times are
    printed (not asserted: the host is shared)."""
    d = Driver()
    d.leader = False
    d.kv_planned = True
    regs = d.register(100, 100)
    assert len(d.sm.targets) == 10_000
    _no_planning_in_apply(monkeypatch)
    times: dict[str, float] = {}

    def commit(what: str) -> None:
        t0 = time.perf_counter()
        reqs = plan_kv(kv_plan_input(d.sm))
        t1 = time.perf_counter()
        for req in reqs:
            data = pb.MetaOp(now_ns=d.now, kv_planned=True, kv_groups=req).SerializeToString()
            assert len(data) < MAX_OP_BYTES
            res = pb.MetaResult.FromString(d.sm.apply(data))
            assert not res.error.code, res.error.message
        times[f"{what} plan"] = t1 - t0
        times[f"{what} apply ({len(reqs)} ops)"] = time.perf_counter() - t1

    d.kv_planned = False  # ops applied by hand below, stamped like a leader's
    for name, red in (("r1", "replica:1"), ("r3", "replica:3"), ("ec", "ec:4+2")):
        op = pb.MetaOp(now_ns=d.now, kv_planned=True)
        op.create_kv_pool.CopyFrom(pb.CreateKVPoolRequest(name=name, redundancy=red, target_memory=MiB))
        t0 = time.perf_counter()
        assert not pb.MetaResult.FromString(d.sm.apply(op.SerializeToString())).error.code
        times[f"create {name} apply"] = time.perf_counter() - t0
        commit(f"create {name}")
    assert [len(g) for g in _pools(d.sm).values()] == [10_000] * 3
    node = regs[17].node_id
    mine = set(d.sm.nodes[node].targets)
    op = pb.MetaOp(now_ns=d.now, kv_planned=True)
    op.drain_node.CopyFrom(pb.DrainNodeRequest(node_id=node, replaced=pb.Replacements(planned=True)))
    t0 = time.perf_counter()
    assert not pb.MetaResult.FromString(d.sm.apply(op.SerializeToString())).error.code
    times["drain apply (pools untouched)"] = time.perf_counter() - t0
    commit("drain")
    pools = _pools(d.sm)
    assert all(len(g) == 9_900 for g in pools.values())
    assert not any(mine & set(m) for g in pools.values() for m in g)
    node_of = {t.id: t.node for t in d.sm.targets.values()}
    assert all(len({node_of[t] for t in m}) == len(m) for g in pools.values() for m in g)
    print("\n10,000 targets, 3 KV pools:", ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in times.items()))


def test_format_3_keeps_the_count_and_holds_a_down_member_until_replace_after() -> None:
    """A leader of op format 3 (KV_HELD_FORMAT): a node going offline
    changes no ``replica:2`` group (its members are held) and no pool's
    group count (12 groups over 10 eligible targets, which apply takes
    from format 3 on and refuses from an older leader); ``replica:1``
    replaces its members at once. Past replace_after the held members are
    replaced in place; back, the node takes positions again, at most one
    per group. The journal replays to the same state."""
    d = Driver()
    d.kv_planned = True
    d.min_format = OP_FORMAT
    d.replace_after_ms = 5000
    d.register(6, 2)
    for name, red in (("r1", "replica:1"), ("r2", "replica:2")):
        d.do("create_kv_pool", pb.CreateKVPoolRequest(name=name, redundancy=red, target_memory=MiB), pb.KVPool)
    start = _pools(d.sm)
    assert {k: len(v) for k, v in start.items()} == {"r1": 12, "r2": 12}
    gone = sorted(d.sm.nodes)[5]
    lost = set(d.sm.nodes[gone].targets)
    d.advance(1)
    d.do("tick", pb.TickRequest(offline_nodes=[gone]))
    down = _pools(d.sm)
    assert len(d.sm.eligible_targets()) == 10 and {k: len(v) for k, v in down.items()} == {"r1": 12, "r2": 12}
    assert down["r2"] == start["r2"]  # held: nothing moved
    assert not any(t in lost for g in down["r1"] for t in g)
    assert [i for i, (a, b) in enumerate(zip(start["r1"], down["r1"], strict=True)) if a != b] == \
        [i for i, g in enumerate(start["r1"]) if g[0] in lost]  # only the dead node's groups
    # an older leader's op with that count is refused: one group per eligible target then
    r2 = next(p for p in d.sm.kv_pools.values() if p.name == "r2")
    old = pb.MetaOp(now_ns=d.now, kv_planned=True, kv_groups=pb.KVGroupsRequest(
        map_version=d.sm.map_version, pools=[pb.KVPoolGroups(pool_id=r2.id, count=12)]))
    res = pb.MetaResult.FromString(d.sm.apply(old.SerializeToString()))
    assert "exceed one per eligible target (10)" in res.error.message
    # replace_after passes: the held members are replaced in place
    d.advance(6)
    d.do("tick", pb.TickRequest(replace_after_ms=d.replace_after_ms))
    d.plan_kv()
    replaced = _pools(d.sm)["r2"]
    assert len(replaced) == 12 and not any(t in lost for g in replaced for t in g)
    assert all(sum(a != b for a, b in zip(x, y, strict=True)) <= 1 for x, y in zip(start["r2"], replaced, strict=True))
    # back: it takes positions again, at most one per group, none in a group just changed
    d.advance(1)
    d.do("heartbeat", pb.HeartbeatRequest(node_id=gone, targets=[pb.TargetReport(target_id=t, capacity=1 << 40)
                                                                 for t in sorted(lost)]), pb.HeartbeatReply)
    back = _pools(d.sm)["r2"]
    assert all(any(t in g for g in back) for t in lost)
    changed = [i for i, (a, b) in enumerate(zip(replaced, back, strict=True)) if a != b]
    assert changed and all(sum(a != b for a, b in zip(replaced[i], back[i], strict=True)) == 1 for i in changed)
    assert not {i for i, (a, b) in enumerate(zip(start["r2"], replaced, strict=True)) if a != b} & set(changed)
    # the journal replays to the same state
    again = MetaStateMachine()
    for op in d.log:
        again.apply(op)
    assert again.digest() == d.sm.digest()
