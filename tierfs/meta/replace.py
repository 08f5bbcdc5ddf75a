"""Replacement of dead, removed or drained targets, planned off the apply.

``RemoveTarget``, ``DrainNode`` and the leader's ``Tick`` (targets down for
``replace_after``) swap a target out of every group it is in. The leader's
service chooses the newcomers here, on inputs copied from the state on the
event loop (:func:`replace_input`), in a worker thread
(:func:`plan_replacements`), and sends the result inside the op
(``Replacements``); apply checks each one in O(width) and applies it
(``MetaStateMachine._apply_replacements``).

The choice is the one apply used to make: for each target in turn, for each
of its groups in id order, the least used eligible target (by group
count, then id) on a node the group does not use yet, not a member, in a
rack under the group's limit (``placement.domain_cap``). Unlike before, a
group whose only candidates would break the rack rule stays stuck (apply
checks the rule; the group stays degraded, and the next change retries).
Cost: one pass over the groups to index the targets being replaced and
count usage, then per replaced member a walk up a heap of the eligible
targets ordered by usage, which stops at the first that fits: O(groups x
width + replacements x (skipped + log targets)) instead of
O(replacements x groups + replacements x targets).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

from tierfs.meta.domains import domain
from tierfs.meta.ops import MAX_REPLACEMENTS
from tierfs.meta.placement import Move, domain_cap
from tierfs.meta.state import MetaStateMachine
from tierfs.proto.v1 import meta_pb2 as pb

__all__ = ["ReplaceInput", "plan_replacements", "replace_input", "replacements_pb"]


@dataclass(frozen=True)
class ReplaceInput:
    tids: list[int]  # the targets to swap out, in order
    eligible: dict[int, int]  # target -> node, what may take their place
    node_of: dict[int, int]  # every target -> node
    doms: dict[int, str]  # every target -> failure domain
    racks: dict[int, str]  # node -> rack label (for domain_cap)
    groups: dict[int, list[int]]
    #: (group, target) pairs not to swap out: the target is down and the
    #: group's other members cannot rebuild what it holds
    #: (MetaStateMachine.rebuild_would_lose); only the tick's replacements.
    held: frozenset[tuple[int, int]] = frozenset()
    #: when set, only these (group, target) pairs are swapped out (a
    #: rebalance move redirected off its full new member), not every group
    #: of ``tids``
    only: frozenset[tuple[int, int]] | None = None
    #: (group, target) pairs where the target may not join the group yet:
    #: it still has to purge an old copy there (MetaStateMachine.purging_in)
    barred: frozenset[tuple[int, int]] = frozenset()


def replace_input(sm: MetaStateMachine, tids: Iterable[int], *, leaving: Iterable[int] = (),
                  hold: bool = False, only: Iterable[tuple[int, int]] | None = None) -> ReplaceInput:
    """A copy of what :func:`plan_replacements` needs (one pass over the
    groups, on the event loop). ``leaving``: targets the op itself makes
    ineligible before it replaces (the removed target, the drained node's).
    ``hold``: leave down targets in place where replacing them would lose
    data (the tick's replacement of long-down targets; an operator's
    ``target rm`` has its own check and ``--force``). ``only``: swap out
    just these (group, target) pairs."""
    out = set(leaving)
    tids = list(tids)
    eligible = {t: n for t, n in sm.eligible_targets().items() if t not in out}
    held: set[tuple[int, int]] = set()
    if hold:
        want = set(tids)
        held = {(g, t) for g, m in sm.groups.items() for t in want.intersection(m) if sm.rebuild_would_lose(g, t)}
    return ReplaceInput(tids, eligible, {t.id: t.node for t in sm.targets.values()}, sm.target_domains(),
                        sm.node_racks(), {g: list(m) for g, m in sm.groups.items()}, frozenset(held),
                        None if only is None else frozenset(only), sm.barred())


def plan_replacements(inp: ReplaceInput, limit: int = MAX_REPLACEMENTS) -> tuple[list[Move], list[int]]:
    """(moves, groups stuck). Pure: runs in a worker thread. At most
    ``limit`` moves; groups beyond count as stuck."""
    groups, eligible, node_of, doms = inp.groups, inp.eligible, inp.node_of, inp.doms
    want = set(inp.tids)
    of: dict[int, list[int]] = {t: [] for t in want}
    for g in sorted(groups):
        for m in set(groups[g]) & want:
            of[m].append(g)
    usage = Counter(chain.from_iterable(groups.values()))
    heap = [(usage.get(c, 0), c) for c in eligible]
    heapq.heapify(heap)
    caps: dict[int, int] = {}
    moves: list[Move] = []
    stuck: list[int] = []
    for tid in inp.tids:
        for gid in of.get(tid, ()):
            members = groups[gid]
            if tid not in members or (gid, tid) in inp.held or (inp.only is not None and (gid, tid) not in inp.only):
                continue
            if len(moves) >= limit:
                stuck.append(gid)
                continue
            w = len(members)
            if w not in caps:
                caps[w] = domain_cap(eligible, w, inp.racks) or w
            others = [m for m in members if m != tid]
            used = {node_of.get(m) for m in others}
            in_rack = Counter(doms.get(m, domain(node_of.get(m, 0), "")) for m in others)
            popped: list[tuple[int, int]] = []
            new = 0
            while heap:
                u, c = heapq.heappop(heap)
                if usage.get(c, 0) != u:
                    continue  # stale entry: c's usage grew, a newer one is in the heap
                popped.append((u, c))
                if (eligible[c] not in used and c not in members and in_rack[doms[c]] < caps[w]
                        and (gid, c) not in inp.barred):
                    new = c
                    break
            for e in popped:
                if e[1] != new:
                    heapq.heappush(heap, e)
            if not new:
                stuck.append(gid)  # nowhere to go: the group stays degraded
                continue
            j = members.index(tid)
            members[j] = new
            usage[new] += 1
            heapq.heappush(heap, (usage[new], new))
            moves.append(Move(gid, j, tid, new))
    return moves, stuck


def replacements_pb(moves: list[Move], stuck: list[int]) -> pb.Replacements:
    return pb.Replacements(planned=True, groups_stuck=stuck, moves=[
        pb.RebalanceMove(group_id=m.group, position=m.position, old_target=m.old, new_target=m.new)
        for m in moves])
