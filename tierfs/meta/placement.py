"""Placement-group generation: which targets hold the fragments of a chunk.

A placement group is an ordered list of ``width`` targets on distinct nodes
(the node is the failure domain). Groups are generated per width in use, one
group per eligible target, greedily: each slot takes the eligible target with
the fewest group memberships so far, then the fewest co-memberships with the
targets already in the group (so a failed target's rebuild reads spread over
many peers), then the lowest id (determinism). Existing groups are never
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
    for grp in existing:
        _count(grp, usage, pair)
    order = sorted(targets)
    first = len(existing)
    out: list[list[int]] = []
    for g in range(want):
        chosen: list[int] = []
        nodes: set[int] = set()
        for _slot in range(width):
            best = min(
                (t for t in order if targets[t] not in nodes),
                key=lambda t: (usage[t], sum(pair[(min(t, c), max(t, c))] for c in chosen), t),
            )
            chosen.append(best)
            nodes.add(targets[best])
        # Rotate so that each target also takes its turn in the data
        # positions (fragment 0..K-1 are the ones read without decoding).
        r = (first + g) % width
        chosen = chosen[r:] + chosen[:r]
        _count(chosen, usage, pair)
        out.append(chosen)
    return out


def _count(grp: list[int], usage: Counter[int], pair: Counter[tuple[int, int]]) -> None:
    for i, a in enumerate(grp):
        usage[a] += 1
        for b in grp[i + 1:]:
            pair[(min(a, b), max(a, b))] += 1
