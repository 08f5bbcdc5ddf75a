"""Failure domains: the rack rule that placement, repair and the rebalancer
all follow (one rule, one place).

A node's rack is its label (storage config ``rack``, ``tierfs node label``);
an unlabelled node is its own failure domain, ``node-<id>`` (the same name
:func:`tierfs.meta.placement.rack_of` gives it). How many members of one
group may share a rack is :func:`tierfs.meta.placement.domain_cap`, the one
place that rule is computed; this module only counts and words it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

__all__ = ["domain", "domain_line", "rack_counts"]


def domain(node: int, label: str) -> str:
    """The failure domain of ``node`` labelled ``label``."""
    return label or f"node-{node}"


def rack_counts(members: Iterable[int], target_rack: Mapping[int, str]) -> Counter[str]:
    return Counter(target_rack[m] for m in members if m in target_rack)


def domain_line(labelled: bool, racks: int, nodes: int, width: int, cap: int) -> str:
    """The ``tierfs status`` sentence about failure domains (``cap``:
    :func:`tierfs.meta.placement.domain_cap` for ``width``)."""
    if not labelled:
        return f"failure domain: node (no rack labels; {nodes} nodes)"
    if racks >= width:
        return f"failure domain: rack ({racks} racks)"
    return (f"failure domain: node (only {racks} racks for width {width}: "
            f"up to {cap} fragments per rack)")
