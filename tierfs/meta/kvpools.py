"""KV pool definitions held by meta: validation, the pool record, its
placement groups and its snapshot encoding.

A KV pool is a cache (docs/kv_pools.md): its objects are spread over the
pool's own placement groups by a stable hash of the key, so meta takes no
operation per key. Remapping a key costs a miss, never data, which is why a
pool's groups are simply re-planned when the eligible targets change, by
the leader (tierfs.meta.kvplan), or by apply for the entries of releases
before leader-planned groups. Since op format 3 the leader keeps the group
count and a redundant pool's down members while a target is only down.

Everything here is a pure function of its arguments; the ops that create and
remove pools live in :mod:`tierfs.meta.state`.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from tierfs.meta.placement import distinct_nodes, plan_groups
from tierfs.meta.undo import Tracked
from tierfs.proto.v1 import meta_pb2 as pb

__all__ = [
    "DEFAULT_POOL_NAME",
    "DEFAULT_POOL_REQUEST",
    "MAX_KV_POOLS",
    "KVPoolRecord",
    "pool_from_json",
    "pool_to_json",
    "replan_groups",
    "set_groups",
]

DEFAULT_POOL_NAME = "default"
#: What ``kv_default_pool`` creates unless configured otherwise: one copy (a
#: lost object is a miss), a memory budget small enough for a laptop and a
#: disk budget that keeps a useful working set across daemon restarts.
DEFAULT_POOL_REQUEST = pb.CreateKVPoolRequest(name=DEFAULT_POOL_NAME, redundancy="replica:1",
                                              target_memory=256 << 20, target_disk=1 << 30)
#: Pools one cluster may hold: every pool is in every cluster map, and each
#: storage daemon keeps an index per pool.
MAX_KV_POOLS = 64


@dataclass(slots=True)
class KVPoolRecord(Tracked):
    id: int
    name: str
    redundancy: str  # canonical ("replica:1", "ec:4+2")
    width: int
    target_memory: int
    target_disk: int
    fsync: bool
    pin_quota: int
    policy: str
    created: int
    # Member target ids of each group; group i has id i + 1 (pool namespace).
    groups: list[list[int]] = field(default_factory=list)
    # Whose namespace a caller's keys live in: "user" (uid) or "group" (gid).
    tenant: str = "user"
    # Parallel to groups: the map version from which each member has held
    # its position without a break (set_groups; 0 = from before this was kept).
    since: list[list[int]] = field(default_factory=list)
    # The latest changes of the group count, oldest first: (map version,
    # count from then on), at most HISTORY_KEPT.
    history: list[list[int]] = field(default_factory=list)

    def to_pb(self) -> pb.KVPool:
        out = pb.KVPool(pool_id=self.id, name=self.name, redundancy=self.redundancy, target_memory=self.target_memory,
                        target_disk=self.target_disk, fsync=self.fsync, pin_quota=self.pin_quota,
                        policy=self.policy, created_ns=self.created, width=self.width,
                        tenant=self.tenant)
        since = self.since
        for i, members in enumerate(self.groups):
            out.groups.append(pb.PlacementGroup(group_id=i + 1, width=len(members), target_ids=members,
                                                member_since=since[i] if i < len(since) else ()))
        for v, n in self.history:
            out.count_history.extend((v, n))
        return out


#: Group count changes a pool remembers (KVPoolRecord.history). A key whose
#: group is older than all of them is bounded by the oldest one kept: its
#: copies from before that are not served (a miss, once).
HISTORY_KEPT = 64


def set_groups(pool: KVPoolRecord, groups: list[list[int]], at: int) -> None:
    """Give ``pool`` these groups from map version ``at`` on, keeping each
    member's ``since`` where it holds the same position as before and
    recording a change of the group count (docs/kv.md, "Overwrites and map
    changes"). Assigns new lists (the undo log tracks assignments)."""
    old, old_since = pool.groups, pool.since
    since: list[list[int]] = []
    for i, g in enumerate(groups):
        prev = old[i] if i < len(old) else None
        ps = old_since[i] if i < len(old_since) else []
        since.append([(ps[j] if j < len(ps) else 0) if prev is not None and j < len(prev) and prev[j] == t else at
                      for j, t in enumerate(g)])
    if len(groups) != len(old) or not pool.history:
        # A pool from before the history was kept starts it with its count
        # then, at version 0 (its keys lived there since, as far as we know).
        hist = [list(h) for h in pool.history] or ([[0, len(old)]] if old else [])
        pool.history = [*hist, [at, len(groups)]][-HISTORY_KEPT:]
    pool.groups = groups
    pool.since = since


def replan_groups(current: list[list[int]], eligible: dict[int, int], width: int, *,
                  keep_down: bool = False, held: Collection[int] = (), count: int | None = None,
                  balance: bool = False, since: list[list[int]] | None = None) -> list[list[int]]:
    """The groups a pool should have over ``eligible`` (target -> node).

    One group per eligible target, as for files. A member no longer eligible
    is replaced in place by the least-used eligible target on a node the
    group does not use; groups are then dropped from, or planned onto, the
    end. Keeping positions stable keeps most keys on the targets that hold
    them (a client hashing keys over the group list in order, with a
    consistent hash such as jump hash, moves only the keys of changed or
    added groups).

    A group some member of which cannot be replaced (no eligible target on a
    node the group does not use) is dropped, and with fewer distinct nodes
    than ``width`` there are no groups at all: the rule of the first
    release, kept as the default because apply replays the ops of that
    release with it. The leader's planner passes ``keep_down``: such a group
    stays as it was, down members and all (the client reads around a target
    the map calls down and writes skip it, as for file groups), so that an
    ``ec:4+2`` pool on six nodes keeps serving with a node down instead of
    losing every group. A group is changed only when all its down members
    can be replaced, so every group an op carries has only eligible members
    (what apply checks, in this release and the one before).

    The leader's planner (op format 3 on) also passes:

    - ``held``: targets that are down but not yet due for replacement
      (``replace_after``). A member in ``held`` keeps its position, as
      ``keep_down`` keeps one that cannot be replaced: the group's other
      copies (or K fragments) go on serving its keys, and the target takes
      its position back when it returns. A group with another member that
      must be replaced has its held members replaced too (an op carries
      eligible members only).
    - ``count``: the group count to keep (the targets present, down ones
      included) instead of one group per eligible target, so that a target
      going down does not drop the last group and move its keys.
    - ``balance``: an eligible target holding fewer positions than half
      the mean (at least one: one that came back after its positions were
      given away, one that just joined a wide pool) takes positions, one at a time,
      from the most used target, in groups whose members are all eligible
      and that this plan has not touched yet (so a group loses at most one
      copy's worth of keys to a plan), those that went longest without a
      change first (by their members' ``since``, the pool's
      ``member_since``): a group whose member was just replaced holds one
      copy fewer of its keys already.
    """
    if distinct_nodes(eligible) < width:
        return [list(g) for g in current if len(g) == width] if keep_down else []
    usage: Counter[int] = Counter(t for g in current for t in g if t in eligible)
    # Eligible targets by (usage, id): a replacement takes the first that
    # fits, the least used as before, without a sort of every target per
    # replaced member (this runs inside apply, at 10,000 targets). Usage
    # only grows here, so an entry whose usage is no longer current is stale.
    heap: list[tuple[int, int]] | None = None
    kept: list[list[int]] = []
    held = frozenset(held)
    for g in current:
        members = list(g)
        ok = len(members) == width
        # Held members stay unless the group changes anyway.
        keep_held = bool(held) and all(t in eligible or t in held for t in members)
        for j, t in enumerate(members):
            if not ok:
                break
            if t in eligible or (keep_held and t in held):
                continue
            if heap is None:
                heap = [(usage[c], c) for c in eligible]
                heapq.heapify(heap)
            nodes = {eligible[m] for m in members if m in eligible}
            popped: list[tuple[int, int]] = []
            new = -1
            while heap:
                e = heapq.heappop(heap)
                if usage[e[1]] != e[0]:
                    continue
                popped.append(e)
                if eligible[e[1]] not in nodes and e[1] not in members:
                    new = e[1]
                    break
            for e in popped:
                if e[1] != new:
                    heapq.heappush(heap, e)
            if new < 0:
                ok = False
                break
            members[j] = new
            usage[new] += 1
            heapq.heappush(heap, (usage[new], new))
        if ok:
            kept.append(members)
        elif keep_down and len(g) == width:
            # Unchanged, down members and all; give back what it took.
            for t in members:
                if t not in g:
                    usage[t] -= 1
                    assert heap is not None
                    heapq.heappush(heap, (usage[t], t))
            kept.append(list(g))
    want = len(eligible) if count is None else count
    if len(kept) > want:
        out = kept[:want]
    else:
        out = kept + plan_groups(eligible, kept, width, want - len(kept))
    if balance:
        _balance(out, current, eligible, width, since or [])
    return out


def _balance(groups: list[list[int]], before: list[list[int]], eligible: dict[int, int], width: int,
             since: list[list[int]]) -> None:
    """Give positions to the eligible targets below the floor of the mean,
    in place (replan_groups' ``balance``). Each move takes a position of
    the most used target in a group whose members are all eligible and
    that neither re-planning nor an earlier move changed, and that has no
    member on the taker's node; it stops when no move narrows the spread."""
    if not eligible or width < 1:
        return
    usage: Counter[int] = Counter({t: 0 for t in eligible})
    # target -> (when its group last changed, index) of the groups it may give up a position in
    holding: dict[int, list[tuple[int, int]]] = {}
    for i, g in enumerate(groups):
        for t in g:
            if t in usage:
                usage[t] += 1
        untouched = i < len(before) and before[i] == g
        if untouched and len(g) == width and all(t in eligible for t in g):
            changed = max(since[i]) if i < len(since) and since[i] else 0
            for t in g:
                holding.setdefault(t, []).append((changed, i))
    for lst in holding.values():
        lst.sort()
    # Half the mean (at least one): a target back after its positions were
    # given away holds none; one that just joined holds one per group
    # added, enough in narrow pools. Each move costs a group one copy of
    # its keys (all of them in replica:1), so no more are made.
    fair = max(1, sum(usage.values()) // len(usage) // 2)
    short = sorted((usage[t], t) for t in usage if usage[t] < fair)
    if not short:
        return
    touched: set[int] = set()
    donors = [(-usage[t], t) for t in usage]
    heapq.heapify(donors)
    for _, taker in short:
        node = eligible[taker]
        while usage[taker] < fair:
            moved = False
            skipped: list[tuple[int, int]] = []
            while donors:
                neg, d = heapq.heappop(donors)
                if -neg != usage[d]:
                    continue  # stale entry
                if usage[d] < usage[taker] + 2:
                    skipped.append((neg, d))
                    break  # no donor left that a move would narrow
                i = next((i for _, i in holding.get(d, ()) if i not in touched
                          and all(eligible[m] != node and m != taker for m in groups[i])), -1)
                skipped.append((neg, d))
                if i < 0:
                    continue
                j = groups[i].index(d)
                groups[i] = [*groups[i][:j], taker, *groups[i][j + 1:]]
                touched.add(i)
                usage[d] -= 1
                usage[taker] += 1
                skipped[-1] = (-usage[d], d)
                moved = True
                break
            for e in skipped:
                heapq.heappush(donors, e)
            if not moved:
                break


def pool_to_json(p: KVPoolRecord) -> list[Any]:
    # tenant, since and history came later; older readers take row[:11] or row[:12]
    extra: list[Any] = [p.tenant, [list(s) for s in p.since], [list(h) for h in p.history]] \
        if p.since or p.history else ([p.tenant] if p.tenant != "user" else [])
    return [p.id, p.name, p.redundancy, p.width, p.target_memory, p.target_disk, p.fsync, p.pin_quota, p.policy,
            p.created, [list(g) for g in p.groups], *extra]


def pool_from_json(row: list[Any]) -> KVPoolRecord:
    (pid, name, red, width, mem, disk, fsync, pin, policy, created, groups) = row[:11]
    # The tenant mode came later: absent (older snapshots, and "user" pools) = "user".
    tenant = row[11] if len(row) > 11 else "user"
    return KVPoolRecord(id=pid, name=name, redundancy=red, width=width, target_memory=mem, target_disk=disk,
                        fsync=fsync, pin_quota=pin, policy=policy, created=created,
                        groups=[list(g) for g in groups], tenant=tenant,
                        since=[list(x) for x in row[12]] if len(row) > 12 else [],
                        history=[list(h) for h in row[13]] if len(row) > 13 else [])
