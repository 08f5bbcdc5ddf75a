"""Failure domains: the rack rule that placement, repair and the rebalancer
all follow (one rule, one place).

A node's rack is its label (storage config ``rack``, ``tierfs node label``);
an unlabelled node is its own failure domain, ``node-<id>``. A group of
``width`` members may put at most :func:`per_rack` of them in one rack:
one when the eligible targets span at least ``width`` racks, otherwise as
evenly as the racks allow (``ceil(width / racks)``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

__all__ = ["domain", "domain_line", "per_rack", "rack_counts", "violates"]


def domain(node: int, label: str) -> str:
    """The failure domain of ``node`` labelled ``label``."""
    return label or f"node-{node}"


def per_rack(width: int, racks: int) -> int:
    """Most members of one group of ``width`` allowed in one rack, with
    ``racks`` failure domains holding eligible targets."""
    if racks <= 0 or width <= 0:
        return max(width, 1)
    return 1 if racks >= width else -(-width // racks)


def rack_counts(members: Iterable[int], target_rack: Mapping[int, str]) -> Counter[str]:
    return Counter(target_rack[m] for m in members if m in target_rack)


def violates(members: Iterable[int], target_rack: Mapping[int, str], racks: int) -> bool:
    """Whether a group breaks the rule (more members in one rack than allowed)."""
    ms = list(members)
    counts = rack_counts(ms, target_rack)
    return bool(counts) and max(counts.values()) > per_rack(len(ms), racks)


def domain_line(labelled: bool, racks: int, nodes: int, width: int) -> str:
    """The ``tierfs status`` sentence about failure domains."""
    if not labelled:
        return f"failure domain: node (no rack labels; {nodes} nodes)"
    if racks >= width:
        return f"failure domain: rack ({racks} racks)"
    return (f"failure domain: node (only {racks} racks for width {width}: "
            f"up to {per_rack(width, racks)} fragments per rack)")
