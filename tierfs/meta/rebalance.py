"""Leader-side placement work: compute on a read of the state, then commit.

The Raft apply never runs the heavy placement code. The leader's service
owns one :class:`Rebalancer`, which

* tops up placement groups (``AddGroups`` ops) after a registration, a
  node back online, a ``SetLayout`` or a ``Create`` of a new width, and
  every ``rebalance_interval``: :func:`plan_top_up` runs
  :func:`tierfs.meta.placement.plan_groups` in a worker thread on inputs
  copied from the state on the event loop (apply runs there too, so the
  copy is consistent), and the op carries the ``map_version`` it was
  computed at: apply refuses it once the map moved, and the next round
  plans again;
* rebalances: :func:`tierfs.meta.placement.plan_rebalance` over the
  eligible targets, the groups and the bytes per group of the state's
  chunk inventory, and submits the moves (``RebalanceMoves``) in batches,
  at most ``max_moving`` groups copying at once. A move is the drain
  mechanism: the new member rebuilds by copy from the old one, which keeps
  serving that position until ``FinishRebuild``; the next batch goes out
  when moves finish. A move of a group that an open write session has
  uploads in waits up to ``write_defer`` seconds for the session to end
  (:func:`groups_being_written`): its writer would otherwise have to send
  those fragments again to the new member before it commits. Never
  longer, so a group that is always being written still moves;
* redirects moves that cannot go on: a move whose new member has been full
  (read-only) or failed for ``redirect_after`` seconds goes on to another
  target (``RedirectMoves``, planned like a drain's replacements,
  :mod:`tierfs.meta.replace`), which inherits the copy source. Before, such
  a move held its group (degraded for writes at that position) and one of
  the ``max_moving`` slots until an operator drained the full node.

Progress (:meth:`Rebalancer.status`) is the ``GetRebalanceStatus`` reply
and the ``tierfs_rebalance_*`` gauges of the process's default Prometheus
registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace

from prometheus_client import Gauge

from tierfs.errors import StaleVersionError, TierFSError
from tierfs.meta.background import BackgroundLoop
from tierfs.meta.ops import MAX_GROUPS_PER_OP, MAX_REPLACEMENTS
from tierfs.meta.placement import Move, plan_groups, plan_rebalance
from tierfs.meta.replace import plan_replacements, replace_input
from tierfs.meta.state import MetaStateMachine
from tierfs.proto.v1 import meta_pb2 as pb

__all__ = ["Rebalancer", "balance", "groups_being_written", "plan_moves", "plan_top_up"]

log = logging.getLogger("tierfs.meta.rebalance")

#: Seconds before a round that left out every move for want of room on its
#: new member plans again (no join or return need start it).
NO_ROOM_RECHECK = 60.0

#: Groups one AddGroups op carries (its list cap, tierfs.meta.ops).
GROUPS_PER_OP = MAX_GROUPS_PER_OP
#: Rounds one top-up plans at most when its ops go stale (the map moved
#: between planning and commit); the periodic round catches up after that.
TOP_UP_ROUNDS = 8
#: Moves one RebalanceMoves op carries.
MOVES_PER_OP = 1024

_G_PLANNED = Gauge("tierfs_rebalance_moves_planned", "Rebalance moves planned and not yet submitted")
_G_FLIGHT = Gauge("tierfs_rebalance_moves_in_flight", "Rebalance moves submitted whose copy has not finished")
_G_DONE = Gauge("tierfs_rebalance_moves_done", "Rebalance moves finished (replicated state)")
_G_TO_MOVE = Gauge("tierfs_rebalance_bytes_to_move", "Bytes of planned and in-flight rebalance moves")
_G_MOVED = Gauge("tierfs_rebalance_bytes_moved", "Bytes copied by finished rebalance moves")
_G_BALANCE = Gauge("tierfs_rebalance_balance_max_over_mean", "Bytes on the fullest eligible target over the mean")
_G_VIOLATIONS = Gauge("tierfs_rebalance_rule_violations", "Groups with more members in one rack than the rule allows")

Submit = Callable[[str, object, type], Awaitable[object]]


@dataclass(frozen=True)
class TopUpInput:
    map_version: int
    widths: list[int]
    eligible: dict[int, int]
    existing: dict[int, list[list[int]]]
    racks: dict[int, str]


def top_up_input(sm: MetaStateMachine, extra_width: int = 0) -> TopUpInput:
    """What :func:`plan_top_up` needs, copied from the state (cheap: one
    pass over the groups), so the planning can run off the event loop."""
    widths = sorted(sm.widths | ({extra_width} if extra_width else set()))
    existing: dict[int, list[list[int]]] = {w: [] for w in widths}
    for g in sorted(sm.groups):
        members = sm.groups[g]
        if len(members) in existing:
            existing[len(members)].append(list(members))
    return TopUpInput(sm.map_version, widths, dict(sm.eligible_targets()), existing, sm.node_racks())


def plan_top_up(inp: TopUpInput, max_groups: int = GROUPS_PER_OP) -> list[pb.AddGroupsRequest]:
    """The AddGroups ops giving every width its share (one group per
    eligible target). Each applied op bumps the map by one, so the n-th
    carries ``map_version + n``. Pure: runs in a worker thread."""
    out: list[pb.AddGroupsRequest] = []
    n = len(inp.eligible)
    for w in inp.widths:
        have = inp.existing[w]
        new = plan_groups(inp.eligible, have, w, n - len(have), racks=inp.racks) if n > len(have) else []
        for i in range(0, len(new), max_groups):
            out.append(pb.AddGroupsRequest(map_version=inp.map_version + len(out), width=w,
                                           groups=[pb.GroupMembers(target_ids=g) for g in new[i:i + max_groups]]))
    return out


@dataclass(frozen=True)
class MoveInput:
    map_version: int
    eligible: dict[int, int]
    groups: dict[int, list[int]]
    group_bytes: dict[int, int]
    racks: dict[int, str]
    busy: frozenset[int]  # groups rebuilding or moving: not moved again now
    #: (group, target) pairs where the target still has to purge an old
    #: copy (MetaStateMachine.purging_in): no move onto it in that group yet
    barred: frozenset[tuple[int, int]] = frozenset()


def move_input(sm: MetaStateMachine) -> MoveInput:
    return MoveInput(sm.map_version, dict(sm.eligible_targets()), {g: list(m) for g, m in sm.groups.items()},
                     dict(sm.gbytes), sm.node_racks(), frozenset(sm.rebuilding) | frozenset(sm.moving),
                     sm.barred())


def plan_moves(inp: MoveInput, tolerance: float = 0.10) -> list[Move]:
    """Every move placement wants now, groups busy rebuilding left out. Pure."""
    moves = plan_rebalance(inp.eligible, inp.groups, inp.group_bytes, racks=inp.racks, tolerance=tolerance)
    return [m for m in moves if m.group not in inp.busy and (m.group, m.new) not in inp.barred]


def groups_being_written(sm: MetaStateMachine) -> set[int]:
    """Groups that hold uploads of open write sessions (chunks begun or
    staged, as the writers' renewals reported them)."""
    out: set[int] = set()
    for s in sm.sessions.values():
        f = sm.inodes.get(s.inode)
        if f is None or not f.groups or not s.uploads:
            continue
        n = len(f.groups)
        slots: set[int] = set()
        for idx, _ in s.uploads:
            slots.add(idx % n)
            if len(slots) == n:
                break
        out.update(f.groups[i] for i in slots)
    return out


def balance(target_bytes: Mapping[int, int], eligible: Mapping[int, int]) -> tuple[float, int, int]:
    """(max / mean, max, mean) of the bytes on the eligible targets (1.0 when empty)."""
    vals = [target_bytes.get(t, 0) for t in eligible]
    if not vals or not sum(vals):
        return 1.0, 0, 0
    mean = sum(vals) / len(vals)
    return max(vals) / mean, max(vals), int(mean)


@dataclass
class _Progress:
    planned: list[Move] = field(default_factory=list)
    plan_version: int = 0
    last_error: str = ""


class Rebalancer(BackgroundLoop):
    """The leader's planner (one per MetaServicer); see the module docstring.

    ``submit(kind, request, reply_cls)`` commits an op the way the service's
    own background ops are committed."""

    task_name = "meta-rebalance"

    def __init__(self, state: Callable[[], MetaStateMachine], submit: Submit, leading: Callable[[], bool], *,
                 enabled: bool = True, interval: float = 5.0, max_moving: int = 4,
                 tolerance: float = 0.10, write_defer: float = 30.0, redirect_after: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, wall_ns: Callable[[], int] = time.time_ns,
                 unreported: Callable[[MetaStateMachine], set[int]] | None = None,
                 free: Callable[[], dict[int, int]] | None = None) -> None:
        self._state = state
        #: bytes each target's file system has free for TierFS, as its node
        #: last reported them (leader memory; targets missing: not known)
        self._free = free
        #: targets to leave out of a round's plan: their node has not
        #: heartbeated to this leader since it registered, so their state
        #: (full: read-only) is not known yet
        self._unreported = unreported
        self._submit = submit
        self._leading = leading
        self.enabled = enabled
        self.interval = interval
        self.max_moving = max(1, max_moving)
        self.tolerance = tolerance
        self.write_defer = write_defer
        self.redirect_after = redirect_after
        self._stuck_since: dict[tuple[int, int], float] = {}  # (group, new member) -> since when redirectable
        self._clock = clock
        self._wall_ns = wall_ns  # the clock the leader stamps ops with (the state clock's source)
        self._held: dict[int, float] = {}  # group -> since when its moves wait for a write session
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._p = _Progress()
        self._active = False
        self._recheck_at: float | None = None  # when to plan again after moves that did not fit
        self._led = False  # leading at the last round

    # ---- group top-up --------------------------------------------------------

    async def top_up(self, extra_width: int = 0, rounds: int = TOP_UP_ROUNDS) -> int:
        """Commit the groups every width (and ``extra_width``) lacks; returns
        how many ops went in. A stale op (the map moved meanwhile: a target
        removed, a node labelled, a heartbeat) ends the round and the next
        round plans again on the state it finds, up to ``rounds`` rounds.
        (One round only, until stop 48: a ``Create`` of a new width racing
        any map change then found no group of its width and failed with
        "needs 2 online targets ..., but only 5 node(s) have one".)"""
        done = 0
        async with self._lock:
            for _ in range(rounds):
                sm = self._state()
                if extra_width and extra_width in sm.widths and any(
                        len(g) == extra_width for g in sm.groups.values()):
                    extra_width = 0
                inp = top_up_input(sm, extra_width)
                if not self._wants_groups(inp):
                    break
                reqs = await asyncio.to_thread(plan_top_up, inp)
                stale = False
                for req in reqs:
                    try:
                        await self._submit("add_groups", req, pb.Empty)
                    except StaleVersionError:
                        stale = True
                        break
                    done += 1
                if not stale:
                    break
                log.debug("group top-up planned at map version %d went stale; planning again", inp.map_version)
        return done

    @staticmethod
    def _wants_groups(inp: TopUpInput) -> bool:
        n = len(inp.eligible)
        return any(len(inp.existing[w]) < n for w in inp.widths)

    # ---- rebalancing ----------------------------------------------------------

    def wake(self) -> None:
        """Plan again soon (a move finished: room for the next batch)."""
        self._wake.set()

    def trigger(self) -> None:
        """Start rebalancing (targets joined or came back, a label changed):
        rounds plan moves until the targets are balanced, then only group
        top-ups run until the next trigger. Data written since does not
        start moves by itself: new writes are spread by placement."""
        self._active = True
        self._wake.set()

    async def step(self) -> int:
        """One round: top up, then plan and submit moves while fewer than
        ``max_moving`` groups copy. Returns the moves submitted."""
        await self.top_up()
        if not self.enabled:
            return 0
        async with self._lock:
            sm = self._state()
            # A new leader picks up moves in flight; groups breaking the
            # rack rule (labels, racks that appeared) are always fixed.
            if not self._active and self._recheck_at is not None and self._clock() >= self._recheck_at:
                self._active = True  # moves left out for want of room: is there room now?
                self._recheck_at = None
            if not (self._active or sm.moving or sm.rule_violations()):
                self._p.planned = []
                return 0
            if await self._redirect(sm):
                sm = self._state()
            room = min(self.max_moving - len(sm.moving), MAX_REPLACEMENTS)  # one op's cap
            inp = move_input(sm)
            # A target whose node registered and has not heartbeated since
            # is neither a source nor a destination this round: a
            # registration carries no target state, so a target already full
            # there (read-only from its first heartbeat on) looked online
            # and empty, and got moves that could never finish. Its first
            # heartbeat (within a second) brings it in, or keeps it out.
            skipped = (self._unreported(sm) if self._unreported is not None else set()) & set(inp.eligible)
            if skipped:
                inp = replace(inp, eligible={t: n for t, n in inp.eligible.items() if t not in skipped})
            wanted = await asyncio.to_thread(plan_moves, inp, self.tolerance)
            moves = self._fit(sm, wanted, inp.group_bytes)
            self._p.planned, self._p.plan_version = moves, inp.map_version
            if not moves and not sm.moving and not skipped:
                self._active = False  # balanced (or as close as the rule allows)
                # Moves left out for want of room on their new member:
                # plan again later (that target may have room by then).
                self._recheck_at = self._clock() + NO_ROOM_RECHECK if wanted else None
            held = self._hold(sm, moves)
            if room <= 0 or not moves:
                return 0
            batch = [m for m in moves if m.group not in held][:min(room, MOVES_PER_OP)]
            if not batch:
                return 0
            req = pb.RebalanceMovesRequest(map_version=inp.map_version, moves=[
                pb.RebalanceMove(group_id=m.group, position=m.position, old_target=m.old, new_target=m.new,
                                 bytes=inp.group_bytes.get(m.group, 0)) for m in batch])
            reply = await self._submit("rebalance_moves", req, pb.RebalanceMovesReply)
            assert isinstance(reply, pb.RebalanceMovesReply)
            sent = {m.group for m in batch} - set(reply.skipped)
            self._p.planned = [m for m in moves if m.group not in sent]
            if reply.applied:
                log.info("rebalance: %d move(s) submitted, %d skipped, %d planned", reply.applied,
                         len(reply.skipped), len(self._p.planned))
            return int(reply.applied)

    def _fit(self, sm: MetaStateMachine, moves: list[Move], group_bytes: Mapping[int, int]) -> list[Move]:
        """The moves whose new member has room for the group's bytes, on top
        of what the moves in flight onto it and those before in the list
        still bring. Placement balances bytes, not bytes over capacity: a
        target smaller than the others would otherwise get moves it cannot
        hold, fill up, have them redirected, get its copies purged, have
        room again, and be chosen again, for ever."""
        free = self._free() if self._free is not None else {}
        if not free or not moves:
            return moves
        owed: Counter[int] = Counter()
        for new, _old, b in sm.moving.values():
            owed[new] += b
        out = []
        for m in moves:
            need = group_bytes.get(m.group, 0)
            room = free.get(m.new)
            if room is not None and owed[m.new] + need > room:
                log.debug("rebalance: no move of group %d onto target %d: %d bytes free, %d needed", m.group,
                          m.new, room, owed[m.new] + need)
                continue
            owed[m.new] += need
            out.append(m)
        return out

    def _redirect_due(self, sm: MetaStateMachine) -> dict[tuple[int, int], float]:
        """(group, member) -> seconds left before the move onto that
        member is redirected (0 or less: due), for every move that may be;
        keeps the since-when of each. It counts from when the member's node
        first reported it full or failed (``Target.full_since``, in the
        replicated state: a new leader goes on counting), else from when
        this leader first saw the move stuck."""
        if self.redirect_after <= 0:
            self._stuck_since.clear()
            return {}
        now = self._clock()
        wall = self._wall_ns()
        since: dict[tuple[int, int], float] = {}
        for g, _, tid in sm.redirectable_moves():
            first = self._stuck_since.get((g, tid), now)
            t = sm.targets.get(tid)
            if t is not None and t.full_since:
                first = min(first, now - max(0.0, (wall - t.full_since) / 1e9))
            since[(g, tid)] = first
        self._stuck_since = since
        return {p: self.redirect_after - (now - since) for p, since in self._stuck_since.items()}

    async def _redirect(self, sm: MetaStateMachine) -> int:
        """Send on the moves stuck on a full or failed new member for
        ``redirect_after``; returns how many went."""
        due = sorted(p for p, left in self._redirect_due(sm).items() if left <= 0)
        if not due:
            return 0
        inp = replace_input(sm, sorted({t for _, t in due}), only=due)
        moves, _ = await asyncio.to_thread(plan_replacements, inp)
        if not moves:
            return 0  # no target can take them now: the next round tries again
        req = pb.RebalanceMovesRequest(map_version=sm.map_version, moves=[
            pb.RebalanceMove(group_id=m.group, position=m.position, old_target=m.old, new_target=m.new)
            for m in moves])
        reply = await self._submit("redirect_moves", req, pb.RebalanceMovesReply)
        assert isinstance(reply, pb.RebalanceMovesReply)
        if reply.applied:
            log.warning("rebalance: %d move(s) redirected off full or failed targets (%s)", reply.applied,
                        ", ".join(f"group {m.group}: {m.old} -> {m.new}" for m in moves
                                  if m.group not in set(reply.skipped)))
        return int(reply.applied)

    def _hold(self, sm: MetaStateMachine, moves: list[Move]) -> set[int]:
        """Groups whose moves wait this round: an open write session has
        uploads in them, for less than ``write_defer`` seconds so far (a
        group written without pause moves once that is over)."""
        if self.write_defer <= 0 or not moves:
            self._held.clear()
            return set()
        writing = groups_being_written(sm) & {m.group for m in moves}
        now = self._clock()
        self._held = {g: self._held.get(g, now) for g in writing}
        held = {g for g, since in self._held.items() if now - since < self.write_defer}
        if held:
            log.debug("rebalance: moves of %d group(s) wait for their write sessions", len(held))
        return held

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()
            if not self._leading():
                self._p = _Progress()
                self._led = False
                continue
            if not self._led:
                # A new leader cannot know whether the one before was part
                # way through rebalancing (planned moves are the leader's
                # own, and a round that left out a just-registered node's
                # targets until its first heartbeat was active only there):
                # it plans rounds until balanced, as after a trigger.
                self._led = True
                self._active = True
            try:
                await self.step()
                self._p.last_error = ""
            except TierFSError as err:  # lost leadership, timeouts: the next round retries
                self._p.last_error = f"{type(err).__name__}: {err}"
                log.debug("rebalance round failed: %s", err)
            self._export()


    # ---- progress ---------------------------------------------------------------

    def status(self) -> pb.RebalanceStatus:
        sm = self._state()
        eligible = sm.eligible_targets()
        ratio, mx, mean = balance(sm.target_bytes(), eligible)
        planned = [m for m in self._p.planned if m.group not in sm.moving]
        gb = sm.gbytes
        in_flight = sum(mv[2] for mv in sm.moving.values())
        due = self._redirect_due(sm) if self._leading() else {}
        return pb.RebalanceStatus(
            enabled=self.enabled, moves_planned=len(planned), moves_in_flight=len(sm.moving),
            moves_done=sm.moves_done, bytes_to_move=sum(gb.get(m.group, 0) for m in planned) + in_flight,
            bytes_moved=sm.bytes_moved, balance_max_over_mean=ratio, bytes_max=mx, bytes_mean=mean,
            targets=len(eligible), racks=sm.eligible_domains(), failure_domain=sm.failure_domain(),
            last_error=self._p.last_error, rule_violations=sm.rule_violations(),
            purges_pending=sm.purges_pending(),
            stuck=[pb.StuckMove(group_id=g, old_target=o, new_target=n, new_node=node, reason=why,
                                redirects=(g, n) in due, redirect_in_s=max(0.0, due.get((g, n), 0.0)))
                   for g, o, n, node, why in sm.stuck_moves()])

    def _export(self) -> None:
        st = self.status()
        _G_PLANNED.set(st.moves_planned)
        _G_FLIGHT.set(st.moves_in_flight)
        _G_DONE.set(st.moves_done)
        _G_TO_MOVE.set(st.bytes_to_move)
        _G_MOVED.set(st.bytes_moved)
        _G_BALANCE.set(st.balance_max_over_mean)
        _G_VIOLATIONS.set(st.rule_violations)
