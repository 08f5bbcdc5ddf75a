"""Scale-out commands: ``tierfs rebalance status`` (the leader's rebalance
progress) and ``tierfs node label ID --rack R`` (a node's failure domain).
Each function returns plain data; :mod:`tierfs.cli.main` prints it."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["add_commands", "execute", "label_node", "rebalance_line", "rebalance_status", "render_rebalance", "stuck_lines"]


async def rebalance_status(meta: Sequence[str], *, timeout: float = 10.0) -> dict[str, Any]:
    """Moves planned, in flight and done, bytes to move and moved, and the
    balance (bytes on the fullest eligible target over the mean)."""
    from tierfs.meta import MetaClient

    async with MetaClient(list(meta), deadline=timeout) as mc:
        st = await mc.rebalance_status()
    return status_dict(st)


#: The rebalancer's default tolerance (``tierfs.meta.rebalance.plan_moves``) as max/mean.
BALANCED_MAX_OVER_MEAN = 1.10


def status_dict(st: Any) -> dict[str, Any]:
    return {
        "enabled": st.enabled, "moves_planned": st.moves_planned, "moves_in_flight": st.moves_in_flight,
        "moves_done": st.moves_done, "bytes_to_move": st.bytes_to_move, "bytes_moved": st.bytes_moved,
        "balance_max_over_mean": round(st.balance_max_over_mean, 4), "bytes_max": st.bytes_max,
        "bytes_mean": st.bytes_mean, "targets": st.targets, "racks": st.racks,
        "failure_domain": st.failure_domain, "rule_violations": st.rule_violations,
        "done": st.moves_planned == 0 and st.moves_in_flight == 0,
        "last_error": st.last_error, "purges_pending": st.purges_pending,
        "stuck": [{"group": m.group_id, "old_target": m.old_target, "new_target": m.new_target,
                   "new_node": m.new_node, "reason": m.reason,
                   "redirect_in_s": round(m.redirect_in_s, 1) if m.redirects else None}
                  for m in st.stuck],
    }


def rebalance_line(r: dict[str, Any]) -> str:
    """One line for ``tierfs status``."""
    from tierfs.cli.util import human_size

    # "balanced" only inside the rebalancer's default band (±10% by bytes):
    # with nothing planned above it (few groups, too few nodes for the
    # rule, a drain since the last round) it said "balanced" at 1.28.
    stuck = r.get("stuck") or []
    state = "off" if not r["enabled"] else (
        "stuck" if stuck and len(stuck) >= r["moves_in_flight"] else "moving") if not r["done"] else (
        "balanced" if r["balance_max_over_mean"] <= BALANCED_MAX_OVER_MEAN else
        f"idle, not balanced (nothing planned; max/mean above {BALANCED_MAX_OVER_MEAN:.2f})")
    return (f"rebalance: {state} ({r['moves_in_flight']} moving"
            + (f" of which {len(stuck)} cannot go on" if stuck else "") + f", {r['moves_planned']} planned, "
            f"{r['moves_done']} done; {human_size(r['bytes_moved'])} moved, {human_size(r['bytes_to_move'])} to "
            f"move; max/mean {_ratio(r['balance_max_over_mean'])} over {r['targets']} targets)")


def _ratio(x: float) -> str:
    """Two decimals, three near the band's edge (1.104 printed as 1.10 next
    to "above 1.10")."""
    return f"{x:.3f}" if abs(x - BALANCED_MAX_OVER_MEAN) < 0.005 else f"{x:.2f}"


def stuck_lines(r: dict[str, Any]) -> list[str]:
    """One line per move in flight that cannot go on (its new member is
    full or down); the rebalance line alone said only "moving"."""
    out = []
    for m in r.get("stuck") or []:
        drain = f"drain its node (`tierfs node drain {m['new_node']}`) to copy it elsewhere"
        what = (f"free space on target {m['new_target']} (the copy resumes), or {drain}" if "full" in m["reason"]
                else f"bring it back, or {drain}; once down for replace_after it is replaced and the copy goes on "
                     f"to its replacement")
        left = m.get("redirect_in_s")
        if left is not None:
            when = f"in {left:.0f} s" if left >= 1 else "as soon as a target can take it"
            what = f"the leader sends it on to another target {when}; or {what}"
        out.append(f"  move of group {m['group']} (target {m['old_target']} -> {m['new_target']}) cannot go on: "
                   f"{m['reason']}; target {m['old_target']} still serves it. {what[0].upper()}{what[1:]}")
    return out


def render_rebalance(r: dict[str, Any]) -> str:
    lines = [rebalance_line(r), *stuck_lines(r), r["failure_domain"]]
    if r["rule_violations"]:
        lines.append(f"groups breaking the rack rule: {r['rule_violations']} (being moved)")
    if r.get("purges_pending"):
        n = r["purges_pending"]
        lines.append(f"old copies to delete: {n} group position(s) that targets no longer hold; their nodes delete "
                     f"them once purge_grace is over")
    if r["last_error"]:
        lines.append(f"last round failed: {r['last_error']}")
    return "\n".join(lines)


async def label_node(meta: Sequence[str], node_id: int, rack: str, *, timeout: float = 20.0) -> dict[str, Any]:
    """Set (or with ``""`` clear) a node's rack; the rebalancer then moves
    the groups that break the rack rule."""
    from tierfs.meta import MetaClient

    async with MetaClient(list(meta), deadline=timeout) as mc:
        await mc.label_node(node_id, rack)
    return {"node": node_id, "rack": rack}


def add_commands(cmd: Callable[..., argparse.ArgumentParser]) -> None:
    p = cmd("rebalance", "rebalancing: status (moves planned, in flight, done; balance by bytes)")
    p.add_argument("action", choices=["status"])


def execute(ns: argparse.Namespace, meta: Sequence[str], emit: Callable[[Any, str | None], None],
            run: Callable[[Any], Any]) -> int | None:
    """Run ``ns`` if it is one of this module's commands; its exit code (None: not ours)."""
    if ns.cmd == "rebalance":
        r = run(rebalance_status(meta, timeout=ns.timeout))
        emit(r, render_rebalance(r))
        return 0
    if ns.cmd == "node" and ns.action == "label":
        if ns.rack is None:
            from tierfs.errors import InvalidArgumentError

            raise InvalidArgumentError("node label: --rack R is required (--rack '' clears the label)")
        r = run(label_node(meta, ns.id, ns.rack, timeout=ns.timeout))
        emit(r, f"node {ns.id}: rack {ns.rack!r}" if ns.rack else f"node {ns.id}: rack label cleared")
        return 0
    return None
