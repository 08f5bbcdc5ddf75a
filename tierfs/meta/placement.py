"""Placement-group generation: which targets hold the fragments of a chunk.

A placement group is an ordered list of ``width`` targets on distinct nodes
(the node is the failure domain). Groups are generated per width in use, one
group per eligible target, greedily: each slot goes to the node whose targets
still lack the most slots to reach an even share (most constrained first),
and within it to its least-used target; ties go to the target with the fewest
co-memberships with the group so far (so a failed target's rebuild reads
spread over many peers), then to the lowest id (determinism). Existing groups are never
rewritten here, so data already placed stays where it is; new targets are
favoured by later groups because their usage starts at zero.

Pure functions of their arguments: every replica computes the same groups.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["distinct_nodes", "plan_groups"]


def distinct_nodes(targets: dict[int, int]) -> int:
    return len(set(targets.values()))


def plan_groups(targets: dict[int, int], existing: list[list[int]], width: int, want: int) -> list[list[int]]:
    """Up to ``want`` new groups of ``width`` targets.

    ``targets`` maps each eligible target id to its node id; ``existing`` are
    the groups of this width already in the table (their members count
    towards usage). Returns ``[]`` if fewer than ``width`` distinct nodes are
    eligible.
    """
    if width < 1 or want < 1 or distinct_nodes(targets) < width:
        return []
    usage: Counter[int] = Counter()
    pair: Counter[tuple[int, int]] = Counter()
    pos: Counter[tuple[int, int]] = Counter()
    for grp in existing:
        _count(grp, usage, pair)
        for j, t in enumerate(grp):
            pos[(t, j)] += 1
    by_node: dict[int, list[int]] = {}
    for t in sorted(targets):
        by_node.setdefault(targets[t], []).append(t)
    # Every target should end with the same share of slots; a node's demand
    # is what its targets still lack. Filling each group from the nodes with
    # the largest remaining demand (most constrained first) is what keeps
    # nodes with many targets from running out of groups to appear in.
    total = sum(usage[t] for t in targets) + want * width
    share = total // len(targets)
    demand = {n: sum(share - usage[t] for t in ts) for n, ts in by_node.items()}
    out: list[list[int]] = []
    for _ in range(want):
        chosen: list[int] = []
        used: set[int] = set()

        for _slot in range(width):
            best_t, best_key = 0, (0, 0, 0)
            for n in sorted(by_node):
                if n in used:
                    continue
                t = min(by_node[n], key=lambda t: (usage[t], _affinity(pair, chosen, t), t))
                key = (-demand[n], _affinity(pair, chosen, t), n)
                if not best_t or key < best_key:
                    best_t, best_key = t, key
            chosen.append(best_t)
            used.add(targets[best_t])
            demand[targets[best_t]] -= 1
            usage[best_t] += 1
        # Order the members so that each target takes its turn at every
        # position: fragments 0..K-1 are the ones read without decoding, so
        # a target always placed first would serve more reads than its share.
        ordered: list[int] = []
        for j in range(width):
            t = min((t for t in chosen if t not in ordered), key=lambda t: (pos[(t, j)], t))
            ordered.append(t)
            pos[(t, j)] += 1
        for t in ordered:
            usage[t] -= 1  # _count adds them back with the pairs
        _count(ordered, usage, pair)
        out.append(ordered)
    return out


def _affinity(pair: Counter[tuple[int, int]], chosen: list[int], t: int) -> int:
    return sum(pair[(min(t, c), max(t, c))] for c in chosen)


def _count(grp: list[int], usage: Counter[int], pair: Counter[tuple[int, int]]) -> None:
    for i, a in enumerate(grp):
        usage[a] += 1
        for b in grp[i + 1:]:
            pair[(min(a, b), max(a, b))] += 1
