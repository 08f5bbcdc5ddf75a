"""``tierfs placement simulate``: the real placement code (tierfs.meta.placement)
run for a described cluster, with no daemons: load balance, rebuild fan-out and
time when a node or a rack fails, and the data moved when a node is added or
removed.

The model (also in docs/scale.md): every member of a group holds the same
bytes (``fill`` per target on average, spread evenly over the groups). A lost
fragment of ``ec:K+M`` is rebuilt by reading K fragments' worth from the
group's survivors (spread evenly over them) and writing it on the replacement
that :func:`replace_members` picks; every group rebuilds in parallel, so the
rebuild takes as long as the busiest disk among the targets taking part needs
at ``--disk-bw`` for its reads plus writes (the network is assumed not to be
the limit).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any, TextIO

from tierfs.meta.placement import (
    Move,
    domain_cap,
    plan_groups,
    plan_rebalance,
    replace_members,
    rule_violations,
)

__all__ = ["add_commands", "execute", "render", "simulate"]

#: Beyond this many group members the simulation needs GiBs of memory.
MAX_SLOTS = 20_000_000


class SimulateError(ValueError):
    """A described cluster that cannot be simulated (the message says why)."""


def _apply(groups: dict[int, list[int]], moves: list[Move]) -> dict[int, list[int]]:
    out = dict(groups)
    for m in moves:
        ms = out[m.group] = list(out[m.group])
        ms[m.position] = m.new
    return out


def _slots(targets: dict[int, int], groups: dict[int, list[int]]) -> dict[int, int]:
    use = dict.fromkeys(targets, 0)
    for ms in groups.values():
        for t in ms:
            if t in use:
                use[t] += 1
    return use


def _rebuild(targets: dict[int, int], groups: dict[int, list[int]], frag: int, k: int, bw: int,
             lost: set[int], racks: dict[int, str]) -> dict[str, Any]:
    """Fan-out and modelled time of rebuilding every fragment on ``lost``."""
    alive = {t: n for t, n in targets.items() if t not in lost}
    hit = {g: ms for g, ms in groups.items() if any(t in lost for t in ms)}
    io: dict[int, float] = {}
    lost_frags = 0
    for ms in hit.values():
        surv = [t for t in ms if t not in lost]
        lost_frags += len(ms) - len(surv)
        if not surv:
            continue
        share = frag * min(k, len(surv)) / len(surv)
        for t in surv:
            io[t] = io.get(t, 0.0) + share
    readers = sorted(io)
    # Replacements see every group's bytes: a target's load is all it holds.
    moves = replace_members(alive, groups, dict.fromkeys(groups, frag), racks=racks, all_targets=targets)
    writers = sorted({m.new for m in moves})
    for m in moves:
        io[m.new] = io.get(m.new, 0.0) + frag
    busiest = max(io.values(), default=0.0)
    return {
        "groups_hit": len(hit),
        "fragments_lost": lost_frags,
        "bytes_lost": lost_frags * frag,
        "fanout_targets": len(readers),
        "fanout_nodes": len({targets[t] for t in readers}),
        "writer_targets": len(writers),
        "unplaced": lost_frags - len(moves),
        "seconds": busiest / bw,
        "seconds_even": sum(io.values()) / max(len(io), 1) / bw,
        "seconds_one_disk": lost_frags * frag / bw,
    }


def simulate(nodes: int, targets_per_node: int, racks: int, k: int, m: int, groups: int = 0,
             disk_bw: int = 200 << 20, fill: int = 1 << 40, tolerance: float = 0.10,
             progress: Callable[[str], None] | None = None, redundancy: str = "") -> dict[str, Any]:
    """Run placement for a cluster of ``nodes`` x ``targets_per_node`` in
    ``racks`` racks (0: unlabelled, each node its own failure domain) with
    groups of width ``k + m`` (``groups`` 0: one per target, as meta makes).
    ``fill``: average bytes per target. Returns the figures as a dict."""
    width = k + m
    if nodes < 1 or targets_per_node < 1:
        raise SimulateError("--nodes and --targets-per-node must be at least 1")
    if nodes < width:
        raise SimulateError(f"width {width} (K+M) needs at least {width} nodes; --nodes is {nodes}")
    if racks < 0 or racks > nodes:
        raise SimulateError(f"--racks must be between 0 (unlabelled) and --nodes ({nodes}); got {racks}")
    for bad, what in ((groups < 0, f"--groups must be >= 0 (0: one per target); got {groups}"),
                      (disk_bw <= 0, f"--disk-bw must be > 0; got {disk_bw}"),
                      (fill <= 0, f"--fill-bytes must be > 0; got {fill}"),
                      (not 0 < tolerance < 1, f"--tolerance must be between 0 and 1 (exclusive); got {tolerance}")):
        if bad:
            raise SimulateError(what)
    ntg = nodes * targets_per_node
    given = groups
    groups = groups or ntg
    if groups * width > MAX_SLOTS:
        fewer = "use fewer --groups" if given else f"fewer --nodes or --targets-per-node (one group per target: {groups:,})"
        raise SimulateError(f"{groups:,} groups of width {width} is over {MAX_SLOTS:,} members; {fewer}")
    if fill * ntg < groups * width:
        # each fragment would be 0 bytes (a division by zero further on)
        raise SimulateError(f"--fill-bytes {fill} per target gives each of the {groups * width:,} fragments less than "
                            f"a byte; give at least {-(-groups * width // ntg)}")
    say = progress or (lambda _msg: None)
    t_start, c_start = time.monotonic(), time.process_time()
    phases: dict[str, float] = {}
    cpu: dict[str, float] = {}
    tmap = {n * targets_per_node + i + 1: n + 1 for n in range(nodes) for i in range(targets_per_node)}
    rmap = {n: (f"rack{(n - 1) * racks // nodes}" if racks else "") for n in range(1, nodes + 1)}
    cap = domain_cap(tmap, width, rmap)
    domains = racks or nodes

    say(f"placing {groups:,} groups of width {width} over {ntg:,} targets")
    t0, c0 = time.monotonic(), time.process_time()
    gm = {i + 1: g for i, g in enumerate(plan_groups(tmap, [], width, groups, racks=rmap))}
    phases["plan_groups"] = time.monotonic() - t0
    cpu["plan_groups"] = time.process_time() - c0
    frag = fill * ntg // (groups * width)
    gb = dict.fromkeys(gm, frag)
    use = _slots(tmap, gm)
    mean = groups * width / ntg
    firsts = dict.fromkeys(tmap, 0)
    for ms in gm.values():
        firsts[ms[0]] += 1
    violations = sum(1 for ms in gm.values() if rule_violations(ms, tmap, cap, rmap))

    say("rebuild of one node and of one rack")
    t0, c0 = time.monotonic(), time.process_time()
    node_lost = {t for t, n in tmap.items() if n == 1}
    node_rb = _rebuild(tmap, gm, frag, k, disk_bw, node_lost, rmap)
    rack1 = {n for n, r in rmap.items() if r == rmap[1]} if racks else {1}
    rack_lost = {t for t, n in tmap.items() if n in rack1}
    rack_rb = _rebuild(tmap, gm, frag, k, disk_bw, rack_lost, rmap)
    phases["rebuild"] = time.monotonic() - t0
    cpu["rebuild"] = time.process_time() - c0
    total = frag * groups * width

    say("adding a node: plan_rebalance")
    t0, c0 = time.monotonic(), time.process_time()
    new_node = nodes + 1
    add_t = dict(tmap)
    for i in range(targets_per_node):
        add_t[ntg + i + 1] = new_node
    add_r = dict(rmap)
    add_r[new_node] = f"rack{nodes % racks}" if racks else ""
    add_moves = plan_rebalance(add_t, gm, gb, racks=add_r, tolerance=tolerance)
    after_add = _apply(gm, add_moves)
    phases["add_node"] = time.monotonic() - t0
    cpu["add_node"] = time.process_time() - c0

    say("removing a node: drain, then plan_rebalance")
    t0, c0 = time.monotonic(), time.process_time()
    gone = {t for t, n in tmap.items() if n == nodes}
    left = {t: n for t, n in tmap.items() if t not in gone}
    drain = replace_members(left, gm, gb, racks=rmap, all_targets=tmap)
    drained = _apply(gm, drain)
    rm_moves = plan_rebalance(left, drained, gb, racks=rmap, tolerance=tolerance)
    after_rm = _apply(drained, rm_moves)
    phases["remove_node"] = time.monotonic() - t0
    cpu["remove_node"] = time.process_time() - c0

    def balance(tg: dict[int, int], gs: dict[int, list[int]]) -> tuple[float, float]:
        u = _slots(tg, gs)
        avg = sum(u.values()) / len(u)
        return max(u.values()) / avg, min(u.values()) / avg

    add_max, add_min = balance(add_t, after_add)
    rm_max, rm_min = balance(left, after_rm)
    # each cluster's own rule: removing a node may leave fewer racks, where
    # more members per rack are allowed (checking the removal against the
    # full cluster's cap counted violations that were none)
    left_r = {n: r for n, r in rmap.items() if n != nodes}
    after_viol = (sum(1 for ms in after_add.values()
                      if rule_violations(ms, add_t, domain_cap(add_t, width, add_r), add_r))
                  + sum(1 for ms in after_rm.values()
                        if rule_violations(ms, left, domain_cap(left, width, left_r), left_r)))
    return {
        "targets": ntg,
        "nodes": nodes,
        "racks": racks,
        "redundancy": redundancy or f"ec:{k}+{m}",
        "width": width,
        "groups": groups,
        "failure_domain": "rack" if racks and cap == 1 else "node",
        "max_per_rack": cap if racks else 1,
        "failure_domains": domains,
        "fill_bytes_per_target": fill,
        "fragment_bytes": frag,
        "disk_bw": disk_bw,
        "tolerance": tolerance,
        "balance_max_over_mean": max(use.values()) / mean,
        "balance_min_over_mean": min(use.values()) / mean,
        "position0_max_over_mean": max(firsts.values()) / (groups / ntg),
        "rack_violations": violations,
        "rebuild_fanout_node": node_rb["fanout_targets"],
        "rebuild_fanout_node_nodes": node_rb["fanout_nodes"],
        "rebuild_writers_node": node_rb["writer_targets"],
        "rebuild_bytes_node": node_rb["bytes_lost"],
        "rebuild_seconds_node": node_rb["seconds"],
        "rebuild_seconds_node_even_spread": node_rb["seconds_even"],
        "rebuild_seconds_node_one_disk": node_rb["seconds_one_disk"],
        "rebuild_fanout_rack": rack_rb["fanout_targets"],
        "rebuild_fanout_rack_nodes": rack_rb["fanout_nodes"],
        "rebuild_writers_rack": rack_rb["writer_targets"],
        "rebuild_bytes_rack": rack_rb["bytes_lost"],
        "rebuild_seconds_rack": rack_rb["seconds"],
        "rebuild_seconds_rack_even_spread": rack_rb["seconds_even"],
        "rebuild_seconds_rack_one_disk": rack_rb["seconds_one_disk"],
        "rebuild_unplaced": node_rb["unplaced"] + rack_rb["unplaced"],
        "moved_fraction_add_node": len(add_moves) * frag / total,
        "moved_fraction_add_node_ideal": 1 / (nodes + 1),
        "moves_add_node": len(add_moves),
        "balance_max_over_mean_after_add": add_max,
        "balance_min_over_mean_after_add": add_min,
        "moved_fraction_remove_node": (len(drain) + len(rm_moves)) * frag / total,
        "moved_fraction_remove_node_ideal": 1 / nodes,
        "moves_remove_node": len(drain) + len(rm_moves),
        # fragments of the removed node that found no new member (too few
        # nodes or racks left for the width): the drain leaves them behind
        "remove_node_unplaced": sum(1 for ms in gm.values() for t in ms if t in gone) - len(drain),
        "balance_max_over_mean_after_remove": rm_max,
        "balance_min_over_mean_after_remove": rm_min,
        "rack_violations_after_moves": after_viol,
        "phase_seconds": {p: round(s, 3) for p, s in phases.items()},
        "phase_cpu_seconds": {p: round(s, 3) for p, s in cpu.items()},
        "seconds": time.monotonic() - t_start,
        "cpu_seconds": time.process_time() - c_start,
    }


def render(r: dict[str, Any]) -> str:
    """The human table of :func:`simulate`'s result."""
    from tierfs.cli.util import human_size
    from tierfs.cli.util import table as _table

    def pct(x: float) -> str:
        return f"{100 * x:.3f}%"

    dom = (f"rack ({r['racks']} racks)" if r["failure_domain"] == "rack" else
           f"node (only {r['racks']} racks for width {r['width']}: up to {r['max_per_rack']} per rack)"
           if r["racks"] else "node (no rack labels)")
    rows = [
        ["load balance (slots, max / mean)", f"{r['balance_max_over_mean']:.4f}",
         f"min / mean {r['balance_min_over_mean']:.4f}"],
        ["fragment 0 (max / mean)", f"{r['position0_max_over_mean']:.3f}", "reads without decode"],
        ["rack-rule violations", r["rack_violations"], "must be 0"],
        ["node lost: rebuild fan-out", f"{r['rebuild_fanout_node']} targets",
         f"on {r['rebuild_fanout_node_nodes']} nodes; {r['rebuild_writers_node']} targets write"],
        ["node lost: rebuild time", f"{r['rebuild_seconds_node']:.0f} s",
         f"{human_size(r['rebuild_bytes_node'])}; perfectly even: {r['rebuild_seconds_node_even_spread']:.0f} s; "
         f"one disk alone: {r['rebuild_seconds_node_one_disk']:.0f} s"],
        ["rack lost: rebuild fan-out", f"{r['rebuild_fanout_rack']} targets",
         f"on {r['rebuild_fanout_rack_nodes']} nodes; {r['rebuild_writers_rack']} targets write"],
        ["rack lost: rebuild time", f"{r['rebuild_seconds_rack']:.0f} s",
         f"{human_size(r['rebuild_bytes_rack'])}; perfectly even: {r['rebuild_seconds_rack_even_spread']:.0f} s; "
         f"one disk alone: {r['rebuild_seconds_rack_one_disk']:.0f} s"],
        ["node added: data moved", pct(r["moved_fraction_add_node"]),
         f"ideal 1/(N+1) = {pct(r['moved_fraction_add_node_ideal'])}; then max/mean "
         f"{r['balance_max_over_mean_after_add']:.3f}, min/mean {r['balance_min_over_mean_after_add']:.3f}"],
        ["node removed: data moved", pct(r["moved_fraction_remove_node"]),
         f"ideal 1/N = {pct(r['moved_fraction_remove_node_ideal'])}; then max/mean "
         f"{r['balance_max_over_mean_after_remove']:.3f}, min/mean {r['balance_min_over_mean_after_remove']:.3f}"],
        ["rule violations after moves", r["rack_violations_after_moves"], "must be 0"],
        *([["NOT PLACED: rebuild", f"{r['rebuild_unplaced']:,} fragments",
            "no eligible target on a node (or rack) the group does not use: "
            "they stay lost (the group degraded) until the cluster grows"]] if r.get("rebuild_unplaced") else []),
        *([["NOT PLACED: node removed", f"{r['remove_node_unplaced']:,} fragments",
            "no eligible target on a node (or rack) the group does not use: "
            "the drain cannot move them off"]] if r.get("remove_node_unplaced") else []),
        ["run time", f"{r['seconds']:.1f} s",
         f"{r['cpu_seconds']:.1f} s of CPU: "
         + ", ".join(f"{p} {s:.1f} s" for p, s in r["phase_cpu_seconds"].items())],
    ]
    head = (f"{r['targets']:,} targets on {r['nodes']:,} nodes, {r['redundancy']}, {r['groups']:,} groups; "
            f"failure domain: {dom}; {human_size(r['fill_bytes_per_target'])} per target, "
            f"disk {human_size(r['disk_bw'])}/s")
    return head + "\n\n" + _table(rows, ["METRIC", "VALUE", "NOTE"])


def _bw(value: str) -> int:
    from tierfs.cli.util import parse_size_arg

    v = value.strip()
    return parse_size_arg(v[:-2] if v.lower().endswith("/s") else v)


def add_commands(cmd: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``placement`` on the ``tierfs`` parser."""
    from tierfs.cli.util import parse_size_arg

    p = cmd("placement", "placement without daemons: simulate a cluster of any size", meta=False)
    p.add_argument("action", choices=["simulate"])
    p.add_argument("--nodes", type=int, default=100, metavar="N", help="storage nodes (default 100)")
    p.add_argument("--targets-per-node", type=int, default=10, metavar="N", help="targets per node (default 10)")
    p.add_argument("--racks", type=int, default=0, metavar="R",
                   help="racks, nodes spread over them in contiguous blocks (default 0: no labels)")
    p.add_argument("--redundancy", default="ec:8+2", help="ec:K+M or replica:N (default ec:8+2)")
    p.add_argument("--groups", type=int, default=0, metavar="N",
                   help="placement groups (default: one per target, as meta makes)")
    p.add_argument("--disk-bw", type=_bw, default=200 << 20, metavar="RATE",
                   help="per-disk bandwidth for the rebuild-time model (default 200MiB/s)")
    p.add_argument("--fill-bytes", type=parse_size_arg, default=1 << 40, metavar="SIZE",
                   help="average bytes stored per target (default 1TiB)")
    p.add_argument("--tolerance", type=float, default=0.10,
                   help="rebalance band around the mean (default 0.10)")


def execute(ns: argparse.Namespace, emit: Callable[[Any, str | None], None], err: TextIO) -> int | None:
    """Run ``ns`` if it is ``placement``; its exit code (None: not ours)."""
    if ns.cmd != "placement":
        return None
    from tierfs.errors import ConfigError
    from tierfs.meta.ops import parse_redundancy

    try:
        _, k, m = parse_redundancy(ns.redundancy)
    except ConfigError as exc:
        raise SimulateError(str(exc)) from None
    start = time.monotonic()

    def progress(msg: str) -> None:
        # Only a run that takes a while says where it is.
        if ns.groups * (k + m) >= 200_000 or ns.nodes * ns.targets_per_node >= 5000 \
                or time.monotonic() - start > 3:
            err.write(f"[{time.monotonic() - start:6.1f} s] {msg}\n")
            err.flush()

    r = simulate(ns.nodes, ns.targets_per_node, ns.racks, k, m, ns.groups, ns.disk_bw, ns.fill_bytes,
                 ns.tolerance, progress, ns.redundancy.strip().lower())
    emit(r, render(r))
    return 0
