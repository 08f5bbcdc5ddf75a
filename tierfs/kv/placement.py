"""Where a KV key lives, and since when each copy may be trusted.

The client's route of a KV pool (:class:`KVPoolRoute`, from the cluster
map), the key -> group mapping (jump consistent hash over the pool's groups
in order) and the placement stamps (docs/kv.md, "Overwrites and map
changes"). Clients and storage daemons both use it (a daemon checks the
copies it serves against its own map), so it imports nothing heavier than
xxhash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from tierfs.errors import UnavailableError

__all__ = ["KVPoolRoute", "group_of", "jump_hash", "jump_span", "mapped_since", "placement"]


@dataclass(frozen=True, slots=True)
class KVPoolRoute:
    """What the client needs of a KV pool: its id, redundancy and groups."""

    pool_id: int
    name: str
    redundancy: str
    copies: int  # replica:N -> N; ec:K+M -> 0
    k: int
    m: int
    groups: tuple[tuple[int, ...], ...]
    # Placement stamps (docs/kv.md, "Overwrites and map changes"): each
    # member's since (parallel to groups), the group count's changes as
    # ((map version, count), ...), and each target's up_since (only those set).
    since: tuple[tuple[int, ...], ...] = ()
    history: tuple[tuple[int, int], ...] = ()
    up: dict[int, int] = field(default_factory=dict, compare=False, hash=False)
    # The largest group count the map or the history has: a key's next
    # jump past it changes nothing (0: not known, work it out).
    top: int = 0
    # (bucket, next jump capped at top) -> the stamps of its positions:
    # kept by placement() for this route (this map) only;
    # at most groups x (top - groups + 1) entries.
    memo: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict, compare=False, hash=False,
                                                         repr=False)

    @classmethod
    def of(cls, p: Any, up: dict[int, int] | None = None) -> KVPoolRoute:
        red = p.redundancy or "replica:1"
        copies = k = m = 0
        kind, _, arg = red.partition(":")
        if kind == "replica":
            copies = int(arg or 1)
        elif kind == "ec":
            a, _, b = arg.partition("+")
            k, m = int(a), int(b)
        h = list(getattr(p, "count_history", ()))
        return cls(p.pool_id, p.name, red, copies, k, m, tuple(tuple(g.target_ids) for g in p.groups),
                   tuple(tuple(getattr(g, "member_since", ())) for g in p.groups),
                   tuple((h[i], h[i + 1]) for i in range(0, len(h) - 1, 2)), dict(up or {}),
                   max([len(p.groups), *h[1::2]]))


#: Jump consistent hash's multiplier (Lamping and Veach, "A Fast, Minimal
#: Memory, Consistent Hash Algorithm", 2014): a 64-bit LCG step.
_JUMP_MUL = 2862933555777941757
_U64 = (1 << 64) - 1


def jump_hash(h: int, n: int) -> int:
    """Jump consistent hash of the 64-bit ``h`` into ``[0, n)``. Going from
    ``n`` buckets to ``n + 1`` moves exactly the keys that land in the new
    last bucket (1/(n+1) of them) and no other; going back moves only those.
    About ln(n) steps."""
    return jump_span(h, n)[0]


def jump_span(h: int, n: int) -> tuple[int, int]:
    """``(b, nx)``: ``jump_hash(h, n)`` and the next point the key jumps at,
    so that the key lands in bucket ``b`` for every count ``m`` with
    ``b < m <= nx`` and in no other."""
    b, j = -1, 0
    while j < n:
        b = j
        h = (h * _JUMP_MUL + 1) & _U64
        j = int((b + 1) * (2147483648.0 / ((h >> 33) + 1)))
    return b, j


def mapped_since(history: Sequence[tuple[int, int]], b: int, nx: int) -> int:
    """The map version from which a key of bucket ``b`` (next jump ``nx``)
    has lived in that bucket without a break, from the pool's group count
    changes (``(version, count)``, oldest first). A spell with no groups
    breaks nothing (no put could go anywhere). 0 when the key has lived
    there since the history began (the pool's creation, with count 0, or
    a version-0 entry: what the pool had before stamps); past the oldest
    change kept (a history cut short), that change's version."""
    for i in range(len(history) - 1, 0, -1):
        m = history[i - 1][1]
        if m and not b < m <= nx:
            return history[i][0]
    if not history:
        return 0
    v0, n0 = history[0]
    return 0 if n0 == 0 or v0 == 0 else v0


def placement(route: KVPoolRoute, key: bytes) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The targets of ``key``'s group, and the placement stamp of each: the
    map version from which that target has held the key's position without
    a break (docs/kv.md, "Overwrites and map changes"). The later of: the
    member's ``since`` in its group, when the key came to this group
    (``mapped_since``) and, where a put skips a target the map calls down
    (every pool but ``replica:1``), the target's ``up_since``. A put sends
    it; a get asks for at least it, so a copy put before a break in its
    holding (it may have missed an overwrite) is a miss."""
    if not route.groups:
        raise UnavailableError(f"KV pool {route.name!r} has no placement groups yet (too few storage nodes?)")
    b, nx = jump_span(xxhash.xxh3_64_intdigest(key), len(route.groups))
    members = route.groups[b]
    if not (route.history or route.up or route.since):
        return members, (0,) * len(members)
    top = route.top or max([len(route.groups), *(c for _, c in route.history)])
    memo_key = (b, min(nx, top))
    stamps = route.memo.get(memo_key)
    if stamps is None:
        floor = mapped_since(route.history, b, nx)
        since = route.since[b] if b < len(route.since) else ()
        up = route.up if route.copies != 1 else {}
        stamps = route.memo[memo_key] = tuple(max(floor, since[j] if j < len(since) else 0, up.get(t, 0))
                                               for j, t in enumerate(members))
    return members, stamps


def group_of(key: bytes, n_groups: int) -> int:
    """The index of the pool group ``key`` lives in (stable across clients):
    jump consistent hash of its xxh3_64 over the pool's groups, in order.

    Re-planning keeps group positions (members replaced in place, groups
    added or dropped at the end: docs/kv_pools.md), so a target joining
    moves 1/N of the keys and one leaving about 2/N (its own keys, which
    are gone anyway, and the last group's). ``xxh3 % n`` before this moved
    nearly every key on any change of the group count: 99% at 100 targets,
    the whole cache lost to misses when one node joined or left."""
    return jump_hash(xxhash.xxh3_64_intdigest(key), n_groups)
