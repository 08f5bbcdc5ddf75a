"""Placement: which targets hold the fragments of a chunk, and how groups move.

A placement group is an ordered list of ``width`` targets on distinct nodes.
Nodes carry a rack label (``""``: the node is its own rack); the rack rule is
that no two members of one group share a rack when at least ``width`` racks
have eligible targets, and otherwise at most ``ceil(width / racks)`` members
share one (raised further only if small racks make even that impossible;
:func:`domain_cap` is the one place that rule is computed).

:func:`plan_groups` generates new groups greedily, most constrained first:
every eligible target should end with the same share of slots, a rack's and a
node's *demand* is what their targets still lack, and each slot goes to the
rack with the largest demand (then that rack's node with the largest demand,
then that node's least-used target). Ties between equal demands are broken by
a draw from a fixed 64-bit LCG taken each time a candidate is put back, so that
equal racks come out in a fresh pseudo-random order every round: groups mix
all racks and a failed target's groups have many distinct peers (rebuild
fan-out) instead of repeating a few fixed blocks. Racks, nodes and targets sit
in heaps keyed by demand, so a group costs ``O(width log racks)``, not a scan.
Each target then takes its turn at every position (fragments ``0..K-1`` are
the ones read without decoding).

:func:`plan_rebalance` moves single members of existing groups so that every
eligible target holds within ``tolerance`` of the mean bytes: first the moves
that fix rule violations, then, repeatedly, from the most loaded target to the
least loaded one that the group's nodes and racks allow, choosing the group
whose size best fits what is needed; it stops as soon as every target is
inside the band, so it moves close to the minimum.

Pure, deterministic functions of their arguments (no set or dict-hash order,
no randomness): every Raft replica and the simulator compute the same result.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "Move",
    "Slot",
    "distinct_nodes",
    "domain_cap",
    "plan_groups",
    "plan_rebalance",
    "rack_of",
    "replace_members",
    "rule_violations",
]

_M64 = (1 << 64) - 1


@dataclass(frozen=True)
class Slot:
    """One eligible target and its failure domains."""

    target: int
    node: int
    rack: str  # "" -> treated as f"node-{node}"


@dataclass(frozen=True)
class Move:
    """Position ``position`` of group ``group`` goes from ``old`` to ``new``."""

    group: int
    position: int
    old: int
    new: int


def distinct_nodes(targets: Mapping[int, int]) -> int:
    return len(set(targets.values()))


def rack_of(node: int, racks: Mapping[int, str] | None) -> str:
    """The failure domain of ``node``: its rack label, else the node itself."""
    label = racks.get(node, "") if racks else ""
    return label or f"node-{node}"


def domain_cap(targets: Mapping[int, int], width: int, racks: Mapping[int, str] | None = None) -> int:
    """The most members of one group of ``width`` that may share a rack.

    1 with at least ``width`` racks holding eligible targets; otherwise
    ``ceil(width / racks)``, raised until the racks' distinct nodes can fill
    a group (one big rack and a few single-node ones). 0 if fewer than
    ``width`` distinct nodes are eligible (no group is possible).
    """
    per_rack: dict[str, set[int]] = {}
    for n in targets.values():
        per_rack.setdefault(rack_of(n, racks), set()).add(n)
    sizes = [len(v) for v in per_rack.values()]
    if width < 1 or sum(sizes) < width:
        return 0
    cap = -(-width // len(sizes))
    while sum(min(cap, s) for s in sizes) < width:
        cap += 1
    return cap


def rule_violations(members: Sequence[int], node_of: Mapping[int, int], cap: int,
                    racks: Mapping[int, str] | None = None) -> int:
    """How many members of a group break the rule: repeats of a node, plus
    members beyond ``cap`` in one rack. Members with no known node count as
    their own domain."""
    nodes: dict[int, int] = {}
    in_rack: dict[str, int] = {}
    bad = 0
    for t in members:
        n = node_of.get(t)
        if n is None:
            continue
        nodes[n] = nodes.get(n, 0) + 1
        if nodes[n] > 1:
            bad += 1
            continue
        r = rack_of(n, racks)
        in_rack[r] = in_rack.get(r, 0) + 1
        if in_rack[r] > cap:
            bad += 1
    return bad


def plan_groups(targets: Mapping[int, int], existing: list[list[int]], width: int, want: int,
                *, racks: Mapping[int, str] | None = None) -> list[list[int]]:
    """Up to ``want`` new groups of ``width`` targets.

    ``targets`` maps each eligible target id to its node id; ``existing`` are
    the groups of this width already in the table (their members count
    towards usage); ``racks`` maps node id -> rack label. Returns ``[]`` if
    fewer than ``width`` distinct nodes are eligible.
    """
    if width < 1 or want < 1:
        return []
    cap = domain_cap(targets, width, racks)
    if cap == 0:
        return []
    tids = sorted(targets)
    ntg = len(tids)
    usage = {t: 0 for t in tids}
    pos = {t: [0] * width for t in tids}  # how often a target held each position
    for grp in existing:
        for j, t in enumerate(grp):
            if t in usage:
                usage[t] += 1
                if j < width:
                    pos[t][j] += 1
    # Demands are scaled by the number of targets so that uneven shares stay
    # integers (exact, so every replica orders candidates the same way).
    total = sum(usage.values()) + want * width
    node_tg: dict[int, list[int]] = {}
    for t in tids:
        node_tg.setdefault(targets[t], []).append(t)
    rack_names = sorted({rack_of(n, racks) for n in node_tg})
    ridx = {name: i for i, name in enumerate(rack_names)}
    node_rack = {n: ridx[rack_of(n, racks)] for n in node_tg}
    nd = {n: sum(total - usage[t] * ntg for t in ts) for n, ts in node_tg.items()}
    rd = [0] * len(rack_names)
    rack_nodes: list[list[int]] = [[] for _ in rack_names]
    for n in sorted(node_tg):
        rd[node_rack[n]] += nd[n]
        rack_nodes[node_rack[n]].append(n)
    lim = [min(cap, len(ns)) for ns in rack_nodes]
    # Ties between equal demands go by a draw from a fixed 64-bit LCG, a new
    # one each time a rack or node is put back: equal racks come out in a
    # fresh order every round, so groups mix them (rebuild fan-out).
    seed = 0x2545F4914F6CDD1D

    def draw() -> int:
        nonlocal seed
        seed = (seed * 6364136223846793005 + 1442695040888963407) & _M64
        return seed

    rack_heap = [(-rd[r], draw(), r) for r in range(len(rack_names))]
    heapq.heapify(rack_heap)
    node_heaps = [[(-nd[n], draw(), n) for n in ns] for ns in rack_nodes]
    for h in node_heaps:
        heapq.heapify(h)
    tg_heaps = {n: [(usage[t], t) for t in ts] for n, ts in node_tg.items()}
    for th in tg_heaps.values():
        heapq.heapify(th)
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    spread = all(x == 1 for x in lim)  # one member per rack: no rack is revisited within a group
    out: list[list[int]] = []
    for _ in range(want):
        chosen: list[int] = []
        if spread:
            picked = [pop(rack_heap)[2] for _ in range(width)]
            for r in picked:
                nh = node_heaps[r]
                n = nh[0][2]
                th = tg_heaps[n]
                u, t = th[0]
                replace(th, (u + 1, t))
                nd[n] -= ntg
                rd[r] -= ntg
                seed = (seed * 6364136223846793005 + 1442695040888963407) & _M64
                replace(nh, (-nd[n], seed, n))
                chosen.append(t)
            for r in picked:
                seed = (seed * 6364136223846793005 + 1442695040888963407) & _M64
                push(rack_heap, (-rd[r], seed, r))
        else:
            held_racks: list[int] = []
            held_nodes: list[int] = []
            count: dict[int, int] = {}
            while len(chosen) < width:
                _, _, r = pop(rack_heap)
                _, _, n = pop(node_heaps[r])
                th = tg_heaps[n]
                u, t = th[0]
                replace(th, (u + 1, t))
                nd[n] -= ntg
                rd[r] -= ntg
                chosen.append(t)
                held_nodes.append(n)
                c = count[r] = count.get(r, 0) + 1
                if c < lim[r]:
                    push(rack_heap, (-rd[r], draw(), r))
                else:
                    held_racks.append(r)
            for r in held_racks:
                push(rack_heap, (-rd[r], draw(), r))
            for n in held_nodes:
                push(node_heaps[node_rack[n]], (-nd[n], draw(), n))
        # Each target takes its turn at every position (as evenly as a greedy
        # pass gets it): a target always placed first would serve more of the
        # reads that need no decode.
        ordered: list[int] = []
        for j in range(width):
            best, bv = -1, 0
            for t in chosen:
                v = pos[t][j]
                if best < 0 or v < bv or (v == bv and t < best):
                    best, bv = t, v
            chosen.remove(best)
            pos[best][j] = bv + 1
            ordered.append(best)
        out.append(ordered)
    return out


# ---- moving members -------------------------------------------------------------


class _Loads:
    """Per-target bytes with a min-heap and a max-heap (lazy: an entry whose
    load is no longer current is dropped when met)."""

    def __init__(self, load: dict[int, int]) -> None:
        self.load = load
        self.lo = [(v, t) for t, v in load.items()]
        self.hi = [(-v, t) for t, v in load.items()]
        heapq.heapify(self.lo)
        heapq.heapify(self.hi)

    def add(self, t: int, b: int) -> None:
        v = self.load[t] = self.load[t] + b
        heapq.heappush(self.lo, (v, t))
        heapq.heappush(self.hi, (-v, t))

    def lowest(self, k: int) -> list[int]:
        """Up to ``k`` distinct targets, least loaded first (ties: lowest id)."""
        got: list[tuple[int, int]] = []
        seen: dict[int, bool] = {}
        while self.lo and len(got) < k:
            v, t = heapq.heappop(self.lo)
            if self.load[t] == v and t not in seen:
                seen[t] = True
                got.append((v, t))
        for e in got:
            heapq.heappush(self.lo, e)
        return [t for _, t in got]

    def highest(self, k: int) -> list[int]:
        got: list[tuple[int, int]] = []
        seen: dict[int, bool] = {}
        while self.hi and len(got) < k:
            v, t = heapq.heappop(self.hi)
            if self.load[t] == -v and t not in seen:
                seen[t] = True
                got.append((v, t))
        for e in got:
            heapq.heappush(self.hi, e)
        return [t for _, t in got]

    def iter_lowest(self) -> list[int]:
        return [t for _, t in sorted((v, t) for t, v in self.load.items())]


class _Groups:
    """The groups (copied on first change), with every known target's node
    and rack as small integers for the validity checks."""

    def __init__(self, targets: Mapping[int, int], groups: Mapping[int, list[int]],
                 all_targets: Mapping[int, int] | None, racks: Mapping[int, str] | None) -> None:
        node_of: dict[int, int] = dict(all_targets or {})
        node_of.update(targets)
        self.node_of = node_of
        names: dict[str, int] = {}
        for n in sorted(set(node_of.values())):
            names.setdefault(rack_of(n, racks), len(names))
        node_rk = {n: names[rack_of(n, racks)] for n in set(node_of.values())}
        self.rack = {t: node_rk[n] for t, n in node_of.items()}
        self.gids = sorted(groups)
        self.members = dict(groups)  # the lists are copied when first changed
        self._copied: dict[int, bool] = {}
        self.caps = {w: max(domain_cap(targets, w, racks), 1) for w in sorted({len(m) for m in groups.values()})}

    def set(self, g: int, pos: int, new: int) -> None:
        if not self._copied.get(g):
            self.members[g] = list(self.members[g])
            self._copied[g] = True
        self.members[g][pos] = new

    def bad(self, g: int) -> list[int]:
        """Positions of ``g`` that break the rule (repeated node, or beyond the
        cap in a rack), in order."""
        ms = self.members[g]
        rk, no = self.rack, self.node_of
        known = [t for t in ms if t in no]
        if len({rk[t] for t in known}) == len(known):
            return []  # every member in its own rack: the common case, checked fast
        cap = self.caps.get(len(ms), 1)
        seen_n: dict[int, int] = {}
        seen_r: dict[int, int] = {}
        out = []
        for j, t in enumerate(ms):
            if t not in no:
                continue
            n, r = no[t], rk[t]
            seen_n[n] = seen_n.get(n, 0) + 1
            seen_r[r] = seen_r.get(r, 0) + 1
            if seen_n[n] > 1 or seen_r[r] > cap:
                out.append(j)
        return out

    def can_take(self, g: int, pos: int, new: int) -> bool:
        """Whether ``new`` may replace the member at ``pos`` of group ``g``."""
        ms = self.members[g]
        if new in ms:
            return False
        no, rk = self.node_of, self.rack
        nn, nr = no[new], rk[new]
        cap = self.caps.get(len(ms), 1)
        in_rack = 0
        for j, t in enumerate(ms):
            if j == pos or t not in no:
                continue
            if no[t] == nn:
                return False
            if rk[t] == nr:
                in_rack += 1
                if in_rack >= cap:
                    return False
        return True


def _scan(targets: Mapping[int, int], gs: _Groups, group_bytes: Mapping[int, int]
          ) -> tuple[dict[int, int], dict[int, list[tuple[int, int]]]]:
    """Bytes per eligible target, and the (group, position) pairs of each
    eligible target in groups that hold bytes, in group order."""
    load = {t: 0 for t in sorted(targets)}
    member_of: dict[int, list[tuple[int, int]]] = {t: [] for t in load}
    members = gs.members
    for g in gs.gids:
        b = group_bytes.get(g, 0)
        if b <= 0:
            continue
        for j, t in enumerate(members[g]):
            if t in load:
                load[t] += b
                member_of[t].append((g, j))
    return load, member_of


def _place(gs: _Groups, loads: _Loads, g: int, pos: int) -> int | None:
    """The least loaded target that may take ``pos`` of ``g`` (None: none may)."""
    k = 16
    while True:
        cands = loads.lowest(k)
        for t in cands:
            if gs.can_take(g, pos, t):
                return t
        if len(cands) < k:
            return None
        if k >= 256:
            for t in loads.iter_lowest()[k:]:
                if gs.can_take(g, pos, t):
                    return t
            return None
        k *= 4


def replace_members(targets: Mapping[int, int], groups: Mapping[int, list[int]],
                    group_bytes: Mapping[int, int], *, racks: Mapping[int, str] | None = None,
                    all_targets: Mapping[int, int] | None = None) -> list[Move]:
    """Replacements for every member that is not eligible (a lost or drained
    target), each by the least loaded eligible target the group's nodes and
    racks allow: what repair or drain would do. Several positions of one group
    may move. ``all_targets`` (target -> node for every target, eligible or
    not) lets the rule count the nodes of members being replaced."""
    gs = _Groups(targets, groups, all_targets, racks)
    load, _ = _scan(targets, gs, group_bytes)
    loads = _Loads(load)
    out: list[Move] = []
    for g in gs.gids:
        for pos, old in enumerate(list(gs.members[g])):
            if old in targets:
                continue
            new = _place(gs, loads, g, pos)
            if new is None:
                continue
            gs.set(g, pos, new)
            loads.add(new, group_bytes.get(g, 0))
            out.append(Move(g, pos, old, new))
    return out


def plan_rebalance(targets: Mapping[int, int], groups: Mapping[int, list[int]],
                   group_bytes: Mapping[int, int], *, racks: Mapping[int, str] | None = None,
                   tolerance: float = 0.10, max_moves: int = 0,
                   all_targets: Mapping[int, int] | None = None) -> list[Move]:
    """Moves that bring every eligible target's bytes within ``tolerance`` of
    the mean (or as close as the rule allows), moving few bytes.

    ``targets``: eligible target -> node; ``groups``: every group (gid ->
    members, any width); ``group_bytes``: bytes each member of a group holds.
    Rule violations are fixed first (empty groups too: new data must not
    land there). Never two moves in one group; members that are not eligible
    are left to repair/drain; ``max_moves`` 0: no cap. ``all_targets``
    (optional, every target -> node) lets the rule see the nodes of members
    that are not eligible.
    """
    if not targets:
        return []
    gs = _Groups(targets, groups, all_targets, racks)
    load, member_of = _scan(targets, gs, group_bytes)
    loads = _Loads(load)
    moved: dict[int, bool] = {}
    out: list[Move] = []

    def full() -> bool:
        return bool(max_moves) and len(out) >= max_moves

    # 1. groups that break the rule (a label changed, or they predate racks):
    # move the most loaded eligible member among those in breach.
    for g in gs.gids:
        bad = gs.bad(g)
        if not bad:
            continue
        if full():
            return out
        ms = gs.members[g]
        for j in sorted((j for j in bad if ms[j] in targets), key=lambda j: (-loads.load[ms[j]], j)):
            new = _place(gs, loads, g, j)
            if new is not None:
                b = group_bytes.get(g, 0)
                loads.add(ms[j], -b)
                loads.add(new, b)
                out.append(Move(g, j, ms[j], new))
                gs.set(g, j, new)
                moved[g] = True
                break

    # 2. balance bytes, most loaded to least loaded, until all are in the band
    n_el = len(loads.load)
    total = sum(loads.load.values())
    lo = int(total * (1.0 - tolerance) / n_el)
    hi = int(total * (1.0 + tolerance) / n_el)
    while not full():
        srcs = loads.highest(8)
        dsts = loads.lowest(8)
        if loads.load[srcs[0]] <= hi and loads.load[dsts[0]] >= lo:
            break
        best: tuple[int, int, int, int] | None = None
        for s in srcs:
            ls = loads.load[s]
            for d in dsts:
                ld = loads.load[d]
                if ld >= lo and ls <= hi:
                    continue
                need = max(lo - ld, ls - hi, 1)
                pick: tuple[int, int, int] | None = None
                for g, j in member_of[s]:
                    if moved.get(g):
                        continue
                    b = group_bytes.get(g, 0)
                    if b >= ls - ld:  # would not even the pair out (and could loop)
                        continue
                    fit = abs(b - need)
                    if (pick is None or fit < pick[0]) and gs.can_take(g, j, d):
                        pick = (fit, g, j)
                        if fit == 0:
                            break
                if pick is not None:
                    best = (s, d, pick[1], pick[2])
                    break
            if best is not None:
                break
        if best is None:
            break
        s, d, g, j = best
        b = group_bytes.get(g, 0)
        loads.add(s, -b)
        loads.add(d, b)
        gs.set(g, j, d)
        moved[g] = True
        out.append(Move(g, j, s, d))
    return out
