"""KV pool groups planned off the apply (docs/kv_pools.md, "Re-planning").

A KV pool's groups follow the eligible targets: when a map bump changes
them, each pool is re-planned by :func:`tierfs.meta.kvpools.replan_groups`
(members no longer eligible replaced in place, groups dropped from or added
at the end). Apply used to do that on every op that bumped the map, O(pools
x groups x width) inside the Raft apply. Now the leader does it: its service
copies the inputs from the state on the event loop (:func:`kv_plan_input`),
plans in a worker thread (:func:`plan_kv`) and commits only the groups that
change, as ``KVGroups`` ops carrying the map version they were planned at
(``MetaStateMachine._op_kv_groups`` checks each group in O(width) and
refuses the op once the map moved). Ops the leader stamps ``kv_planned``
no longer re-plan in apply; older entries (without it) replay through the
old in-apply path unchanged.

:class:`KVPlanner` runs the planning: after every op of the leader's that
bumped the map (the service waits for it before replying, so a caller sees
the pools fitted, as when apply planned them) and every ``interval`` (a new
leader, an op that raced). Between the map bump and the ``KVGroups`` op a
pool may still name a target just gone: a client sees a miss or a failed
put there, as it does with a map it has not refreshed yet; KV objects are a
cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tierfs.errors import StaleVersionError, TierFSError
from tierfs.meta.background import BackgroundLoop
from tierfs.meta.kvpools import replan_groups
from tierfs.meta.ops import MAX_KV_GROUP_CHANGES
from tierfs.meta.state import KV_HELD_FORMAT, OP_FORMAT, MetaStateMachine
from tierfs.proto.v1 import meta_pb2 as pb

__all__ = ["KVPlanInput", "KVPlanner", "kv_plan_input", "plan_kv"]

log = logging.getLogger("tierfs.meta.kvplan")

#: Group members one KVGroups op carries at most (with target ids under
#: 2^21, about 3 bytes each: well inside MAX_OP_BYTES with the per-group
#: overhead); a larger plan goes out in several ops.
MEMBERS_PER_OP = 32_768

Submit = Callable[[str, object, type], Awaitable[object]]


@dataclass(frozen=True)
class KVPlanInput:
    map_version: int
    eligible: dict[int, int]  # target -> node
    pools: dict[int, tuple[int, list[list[int]]]]  # pool id -> (width, groups)
    #: Down targets whose positions redundant pools keep (not yet down for
    #: replace_after); None: plan as op format 2 did (no held targets, one
    #: group per eligible target, no balancing).
    held: frozenset[int] | None = None
    #: The group count to keep (the targets present, down ones included).
    count: int = 0
    #: pool id -> its groups' member_since (which groups changed last)
    since: dict[int, list[list[int]]] = field(default_factory=dict)


def kv_plan_input(sm: MetaStateMachine, *, now_ns: int | None = None,
                  replace_after_ms: int | None = None) -> KVPlanInput:
    """A copy of what :func:`plan_kv` needs (one pass over the pools'
    groups, on the event loop, where apply runs too: consistent). With
    ``replace_after_ms`` (a leader of op format 3 on; 0 = never replace),
    down targets are held and the group count kept; without, the plan is
    op format 2's."""
    pools = {pid: (p.width, [list(g) for g in p.groups]) for pid, p in sm.kv_pools.items()}
    if replace_after_ms is None:
        return KVPlanInput(sm.map_version, dict(sm.eligible_targets()), pools)
    held, count = sm.kv_held_targets(time.time_ns() if now_ns is None else now_ns, replace_after_ms)
    since = {pid: [list(x) for x in p.since] for pid, p in sm.kv_pools.items()}
    return KVPlanInput(sm.map_version, dict(sm.eligible_targets()), pools, held, count, since)


def plan_kv(inp: KVPlanInput, *, max_changes: int = MAX_KV_GROUP_CHANGES,
            max_members: int = MEMBERS_PER_OP) -> list[pb.KVGroupsRequest]:
    """The KVGroups ops bringing every pool to ``replan_groups``' choice
    (none when all fit). Each applied op bumps the map by one, so the n-th
    carries ``map_version + n``; a pool's changes are cut over several ops
    at ``max_changes`` groups or ``max_members`` members. Pure: runs in a
    worker thread."""
    out: list[pb.KVGroupsRequest] = []
    cur_op: pb.KVGroupsRequest | None = None
    changes = members = 0

    def room(width: int) -> pb.KVGroupsRequest:
        nonlocal cur_op, changes, members
        if cur_op is None or changes + 1 > max_changes or members + width > max_members:
            cur_op = pb.KVGroupsRequest(map_version=inp.map_version + len(out))
            out.append(cur_op)
            changes = members = 0
        return cur_op

    for pid in sorted(inp.pools):
        width, cur = inp.pools[pid]
        if inp.held is None:
            new = replan_groups(cur, inp.eligible, width, keep_down=True)
        else:
            # replica:1 keeps no down member: its only copy is gone, and a
            # new member takes the keys' puts at once.
            new = replan_groups(cur, inp.eligible, width, keep_down=True,
                                held=inp.held if width > 1 else (), count=inp.count, balance=True,
                                since=inp.since.get(pid))
        diffs = [(i, g) for i, g in enumerate(new) if i >= len(cur) or g != cur[i]]
        if not diffs and len(new) == len(cur):
            continue
        if not diffs:  # only a shorter list
            room(0).pools.add(pool_id=pid, count=len(new))
            continue
        piece: pb.KVPoolGroups | None = None
        piece_op: pb.KVGroupsRequest | None = None
        for i, g in diffs:
            op = room(width)
            if piece is None or piece_op is not op:
                # A pool that grows grows as far as its pieces so far reach.
                piece = op.pools.add(pool_id=pid, count=len(new) if len(new) <= len(cur) else len(cur))
                piece_op = op
            piece.groups.add(index=i, target_ids=g)
            piece.count = max(piece.count, i + 1)
            changes += 1
            members += width
    return out


class KVPlanner(BackgroundLoop):
    """The leader's KV pool planner (one per MetaServicer); see the module
    docstring. ``submit(kind, request, reply_cls)`` commits an op the way
    the service's own background ops are committed."""

    task_name = "meta-kvplan"

    def __init__(self, state: Callable[[], MetaStateMachine], submit: Submit, leading: Callable[[], bool], *,
                 interval: float = 5.0, replace_after: float = 0.0) -> None:
        self._state = state
        self._submit = submit
        self._leading = leading
        self.interval = interval
        #: meta's replace_after: how long redundant pools keep a down member
        self.replace_after_ms = int(replace_after * 1000)
        self._lock = asyncio.Lock()
        #: (map version, held targets) at which the pools were last found fitted
        self._settled: tuple[int, frozenset[int] | None] = (-1, None)

    def _input(self, sm: MetaStateMachine) -> KVPlanInput:
        # A leader of an older format (played in tests) plans as it did.
        return kv_plan_input(sm, replace_after_ms=self.replace_after_ms if OP_FORMAT >= KV_HELD_FORMAT else None)
        #: (seconds planning, ops committed) of the last plan that changed something
        self.last: tuple[float, int] = (0.0, 0)

    async def settle(self, rounds: int = 4) -> int:
        """Commit the groups the pools lack at the current map version;
        returns how many KVGroups ops went in. A stale op (the map moved
        meanwhile) ends the batch and the next round plans again."""
        done = 0
        async with self._lock:
            for _ in range(rounds):
                sm = self._state()
                if not sm.kv_pools:
                    break
                held = sm.kv_held_targets(time.time_ns(), self.replace_after_ms)[0] \
                    if OP_FORMAT >= KV_HELD_FORMAT else None
                if (sm.map_version, held) == self._settled:
                    break
                inp = self._input(sm)
                t0 = time.perf_counter()
                reqs = await asyncio.to_thread(plan_kv, inp)
                took = time.perf_counter() - t0
                if not reqs:
                    self._settled = (inp.map_version, inp.held)
                    break
                n = 0
                for req in reqs:
                    try:
                        await self._submit("kv_groups", req, pb.Empty)
                    except StaleVersionError:
                        break
                    n += 1
                done += n
                self.last = (took, n)
                log.info("kv pools: %d group op(s) committed at map version %d (planned in %.3f s)",
                         n, inp.map_version, took)
        return done

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if not self._leading():
                continue
            try:
                await self.settle()
            except TierFSError as err:  # lost leadership, timeouts: the next round retries
                log.debug("kv pool planning failed: %s", err)

