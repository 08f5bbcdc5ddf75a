"""Scale-out commands: ``tierfs rebalance status`` (the leader's rebalance
progress) and ``tierfs node label ID --rack R`` (a node's failure domain).
Each function returns plain data; :mod:`tierfs.cli.main` prints it."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["add_commands", "execute", "label_node", "rebalance_line", "rebalance_status", "render_rebalance"]


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
        "last_error": st.last_error,
    }


def rebalance_line(r: dict[str, Any]) -> str:
    """One line for ``tierfs status``."""
    from tierfs.cli.util import human_size

    # "balanced" only inside the rebalancer's default band (±10% by bytes):
    # with nothing planned above it (few groups, too few nodes for the
    # rule, a drain since the last round) it said "balanced" at 1.28.
    state = "off" if not r["enabled"] else "moving" if not r["done"] else (
        "balanced" if r["balance_max_over_mean"] <= BALANCED_MAX_OVER_MEAN else
        f"idle, not balanced (nothing planned; max/mean above {BALANCED_MAX_OVER_MEAN:.2f})")
    return (f"rebalance: {state} ({r['moves_in_flight']} moving, {r['moves_planned']} planned, "
            f"{r['moves_done']} done; {human_size(r['bytes_moved'])} moved, {human_size(r['bytes_to_move'])} to "
            f"move; max/mean {_ratio(r['balance_max_over_mean'])} over {r['targets']} targets)")


def _ratio(x: float) -> str:
    """Two decimals, three near the band's edge (1.104 printed as 1.10 next
    to "above 1.10")."""
    return f"{x:.3f}" if abs(x - BALANCED_MAX_OVER_MEAN) < 0.005 else f"{x:.2f}"


def render_rebalance(r: dict[str, Any]) -> str:
    lines = [rebalance_line(r), r["failure_domain"]]
    if r["rule_violations"]:
        lines.append(f"groups breaking the rack rule: {r['rule_violations']} (being moved)")
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
