"""Placement algorithms (tierfs.meta.placement): the rack rule, balance,
rebuild fan-out, determinism across processes, and rebalancing moves."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from tierfs.cli.main import run
from tierfs.meta.placement import (
    Move,
    domain_cap,
    plan_groups,
    plan_rebalance,
    replace_members,
    rule_violations,
)

pytestmark = pytest.mark.timeout(60)


def cluster(nodes: int, per_node: int, racks: int) -> tuple[dict[int, int], dict[int, str]]:
    """Targets 1.. numbered node by node; nodes in contiguous blocks per rack."""
    targets: dict[int, int] = {}
    for n in range(1, nodes + 1):
        for _ in range(per_node):
            targets[len(targets) + 1] = n
    return targets, {n: f"r{(n - 1) * racks // nodes}" for n in range(1, nodes + 1)}


def loads(targets: dict[int, int], groups: dict[int, list[int]], gb: dict[int, int]) -> Counter[int]:
    c: Counter[int] = Counter({t: 0 for t in targets})
    for g, ms in groups.items():
        for t in ms:
            if t in targets:
                c[t] += gb.get(g, 0)
    return c


def test_rack_rule_with_enough_racks() -> None:
    targets, racks = cluster(60, 2, 12)
    groups = plan_groups(targets, [], 10, 300, racks=racks)
    assert len(groups) == 300
    assert domain_cap(targets, 10, racks) == 1
    for g in groups:
        assert len({racks[targets[t]] for t in g}) == 10, f"group {g} repeats a rack"
        assert rule_violations(g, targets, 1, racks) == 0
    use = Counter(t for g in groups for t in g)
    assert max(use.values()) - min(use.values()) <= 1


def test_rack_rule_with_fewer_racks_spreads_evenly() -> None:
    targets, racks = cluster(12, 1, 4)  # 4 racks of 3 nodes, width 6: at most 2 per rack
    assert domain_cap(targets, 6, racks) == 2
    groups = plan_groups(targets, [], 6, 40, racks=racks)
    for g in groups:
        per_rack = Counter(racks[targets[t]] for t in g)
        assert max(per_rack.values()) <= 2 and len({targets[t] for t in g}) == 6
    # one big rack and two single-node racks: the cap rises so a group still fits
    t2 = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5}
    r2 = {1: "a", 2: "a", 3: "a", 4: "b", 5: "c"}
    assert domain_cap(t2, 5, r2) == 3
    for g in plan_groups(t2, [], 5, 5, racks=r2):
        assert sorted(g) == [1, 2, 3, 4, 5]
    assert plan_groups(t2, [], 6, 5, racks=r2) == []  # fewer nodes than the width


def test_unlabelled_nodes_are_their_own_rack() -> None:
    targets, _ = cluster(8, 3, 8)
    a = plan_groups(targets, [], 4, 24)
    assert a == plan_groups(targets, [], 4, 24, racks={n: "" for n in range(1, 9)})
    for g in a:
        assert len({targets[t] for t in g}) == 4


def test_balance_and_rebuild_fanout_at_scale() -> None:
    targets, racks = cluster(100, 4, 20)  # 400 targets, width 10, 4000 groups
    groups = plan_groups(targets, [], 10, 4000, racks=racks)
    use = Counter(t for g in groups for t in g)
    mean = 4000 * 10 / len(targets)
    assert max(use.values()) / mean <= 1.02 and min(use.values()) / mean >= 0.98
    # Node 1's groups must reach nearly every node outside its rack, not a
    # few fixed blocks of racks.
    lost = {t for t, n in targets.items() if n == 1}
    peers = {targets[t] for g in groups if lost & set(g) for t in g} - {1}
    assert len(peers) >= 0.9 * (100 - 5)
    # positions rotate: no target is fragment 0 far more often than its share
    firsts = Counter(g[0] for g in groups)
    assert max(firsts.values()) <= 1.5 * 4000 / len(targets)


def test_existing_groups_count_and_new_targets_are_favoured() -> None:
    targets, racks = cluster(10, 1, 10)
    first = plan_groups(targets, [], 5, 10, racks=racks)
    targets[11], targets[12] = 11, 12
    racks[11], racks[12] = "r0", "r1"
    more = plan_groups(targets, first, 5, 2, racks=racks)
    use = Counter(t for g in more for t in g)
    assert use[11] == 2 and use[12] == 2  # they start with no slots


SNIPPET = """
import json, sys
from tierfs.meta.placement import plan_groups, plan_rebalance
t = {i: (i - 1) // 3 + 1 for i in range(1, 91)}
r = {n: "r%d" % (n % 7) for n in range(1, 31)}
g = plan_groups(t, [], 6, 90, racks=r)
t[91] = t[92] = t[93] = 31
r[31] = "r3"
gm = {i + 1: m for i, m in enumerate(g)}
mv = plan_rebalance(t, gm, {i: 100 + i % 5 for i in gm}, racks=r)
print(json.dumps([g, [[m.group, m.position, m.old, m.new] for m in mv]]))
"""


def test_deterministic_across_processes() -> None:
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = "12345"  # str and set order differ from this process's
    r = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, env=env,
                       timeout=30, check=True)
    here: dict[str, object] = {}
    exec(SNIPPET.replace("print(", "out = ("), here)  # the same code in this process
    assert json.loads(r.stdout) == json.loads(str(here["out"]))
    assert json.loads(r.stdout)[1], "the added node must receive moves"


def test_rebalance_after_adding_a_node_moves_close_to_one_nth() -> None:
    targets, racks = cluster(40, 5, 20)  # 200 targets
    gm = {i + 1: m for i, m in enumerate(plan_groups(targets, [], 10, 2000, racks=racks))}
    gb = {g: 1 << 20 for g in gm}
    for i in range(5):
        targets[201 + i] = 41
    racks[41] = "r7"
    moves = plan_rebalance(targets, gm, gb, racks=racks)
    assert len({m.group for m in moves}) == len(moves), "two moves in one group"
    after = {g: list(ms) for g, ms in gm.items()}
    for m in moves:
        assert after[m.group][m.position] == m.old
        after[m.group][m.position] = m.new
    ld = loads(targets, after, gb)
    mean = sum(ld.values()) / len(targets)
    assert max(ld.values()) <= 1.1 * mean and min(ld.values()) >= 0.9 * mean
    for ms in after.values():
        assert rule_violations(ms, targets, 1, racks) == 0
    moved = len(moves) * (1 << 20) / sum(ld.values())
    assert 0.85 / 41 <= moved <= 1.1 / 41, moved
    assert plan_rebalance(targets, after, gb, racks=racks) == []  # balanced: nothing to do
    assert len(plan_rebalance(targets, gm, gb, racks=racks, max_moves=7)) == 7


def test_rebalance_fixes_rack_violations_first() -> None:
    targets, racks = cluster(12, 1, 12)
    gm = {i + 1: m for i, m in enumerate(plan_groups(targets, [], 4, 12, racks=racks))}
    racks = {n: "same" if n <= 3 else racks[n] for n in racks}  # relabel: nodes 1-3 in one rack
    bad = [g for g, ms in gm.items() if rule_violations(ms, targets, 1, racks)]
    assert bad
    moves = plan_rebalance(targets, gm, dict.fromkeys(gm, 10), racks=racks)
    assert [m.group for m in moves[:len(bad)]] == bad
    after = {g: list(ms) for g, ms in gm.items()}
    for m in moves:
        after[m.group][m.position] = m.new
    assert all(rule_violations(ms, targets, 1, racks) == 0 for ms in after.values())


def test_replace_members_of_a_removed_node() -> None:
    targets, racks = cluster(20, 2, 10)
    gm = {i + 1: m for i, m in enumerate(plan_groups(targets, [], 6, 40, racks=racks))}
    gone = {t for t, n in targets.items() if n == 20}
    left = {t: n for t, n in targets.items() if t not in gone}
    moves = replace_members(left, gm, dict.fromkeys(gm, 1), racks=racks, all_targets=targets)
    assert sorted(m.old for m in moves) == sorted(t for ms in gm.values() for t in ms if t in gone)
    for m in moves:
        ms = list(gm[m.group])
        ms[m.position] = m.new
        assert rule_violations(ms, left, 1, racks) == 0 and isinstance(m, Move)


def test_cli_simulate_json_and_bad_arguments() -> None:
    out, err = io.StringIO(), io.StringIO()
    code = run(["placement", "simulate", "--nodes", "16", "--targets-per-node", "2", "--racks", "8",
                "--redundancy", "ec:4+2", "--groups", "160", "--disk-bw", "100MiB/s", "--fill-bytes", "1GiB",
                "--json"], stdout=out, stderr=err, env={})
    assert code == 0, err.getvalue()
    r = json.loads(out.getvalue())
    assert r["targets"] == 32 and r["width"] == 6 and r["failure_domain"] == "rack"
    assert r["balance_max_over_mean"] <= 1.05 and r["rack_violations"] == 0
    assert r["rack_violations_after_moves"] == 0 and r["rebuild_unplaced"] == 0
    assert 0 < r["rebuild_fanout_node"] <= 30 and r["rebuild_fanout_rack"] > 0
    assert r["disk_bw"] == 100 << 20 and r["rebuild_seconds_node"] > 0
    assert 0.5 * r["moved_fraction_add_node_ideal"] <= r["moved_fraction_add_node"] <= \
        1.2 * r["moved_fraction_add_node_ideal"]
    assert r["moved_fraction_remove_node"] >= r["moved_fraction_remove_node_ideal"] * 0.99
    assert r["seconds"] > 0
    out = io.StringIO()
    assert run(["placement", "simulate", "--nodes", "12", "--racks", "4", "--redundancy", "ec:4+2"],
               stdout=out, stderr=err, env={}) == 0
    assert "up to 2 per rack" in out.getvalue() and "node added" in out.getvalue()
    assert "NOT PLACED" not in out.getvalue()
    # Too few nodes for the width after a loss: the text says what it could not place (it only
    # showed "data moved 0.000%" and a rebuild time, the count being in --json alone).
    out = io.StringIO()
    assert run(["placement", "simulate", "--nodes", "6", "--targets-per-node", "1", "--racks", "3",
                "--redundancy", "ec:4+2"], stdout=out, stderr=err, env={}) == 0
    assert "NOT PLACED: rebuild" in out.getvalue() and "NOT PLACED: node removed" in out.getvalue(), out.getvalue()
    # Removing the only node of a rack leaves fewer racks, where more members per rack
    # are allowed: no violation (it counted 8, against the full cluster's rule).
    out = io.StringIO()
    assert run(["placement", "simulate", "--nodes", "4", "--targets-per-node", "2", "--racks", "3",
                "--redundancy", "ec:2+1", "--json"], stdout=out, stderr=err, env={}) == 0
    assert json.loads(out.getvalue())["rack_violations_after_moves"] == 0
    for bad, msg in ((["--nodes", "5"], "needs at least 10 nodes"), (["--racks", "200"], "--racks"),
                     (["--redundancy", "ec:8"], "redundancy"), (["--disk-bw", "fast"], "not a size"),
                     # a fragment of 0 bytes: it was a ZeroDivisionError traceback
                     (["--nodes", "10", "--fill-bytes", "5"], "--fill-bytes 5 per target gives each"),
                     (["--nodes", "10", "--tolerance", "2"], "--tolerance must be between 0 and 1"),
                     (["--nodes", "1000000000"], "fewer --nodes or --targets-per-node")):
        err = io.StringIO()
        assert run(["placement", "simulate", *bad], stdout=io.StringIO(), stderr=err, env={}) == 2
        assert msg in err.getvalue(), err.getvalue()
