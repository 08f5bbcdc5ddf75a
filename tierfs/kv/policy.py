"""Eviction and admission policies for the KV-cache tiers and the storage-daemon KV store.

A policy only orders what its owner tells it is resident; the owner (a tier, the
per-target KV store, the trace simulator) counts bytes and calls
:meth:`EvictionPolicy.pop_victim` until what it holds fits. Pinned objects are
not in the policy at all (the owner removes them at pin and re-inserts them at
unpin), so a victim is always evictable.

Policies (``make_policy(name)``; measured in ``docs/kv_policies.md``):

``lru``
    The baseline: evict the least recently used object.
``leaf-lru``
    LRU among the leaves of the prefix forest: a block whose children (blocks
    inserted with it as ``parent``) are resident is not evicted before them,
    because evicting a prefix block wastes every cached block after it. Never
    measurably worse than LRU on the traces measured. (The default policy is
    ``lru``; ``chain`` is the one measured best on prefix-reuse traces.)
``s3fifo``
    S3-FIFO (Yang et al., SOSP'23): new objects enter a small FIFO (10% of the
    resident bytes); only those hit again while there move to the main FIFO,
    the rest leave a ghost entry, and a ghost that comes back goes straight to
    main. Main is a CLOCK-like FIFO that reinserts objects hit since their last
    pass. It keeps one-shot blocks (most KV blocks) from flushing reused ones;
    it wins most where reuse is far apart and loses at small capacities when
    reuse comes at the second sighting (chat turns).
``arc``
    ARC (Megiddo & Modha): recency and frequency lists whose split adapts on
    ghost hits.
``chain``
    The policy for prefix-reuse workloads: S3-FIFO whose small-queue share adapts
    the way ARC's does (a ghost hit on a small-queue victim grows it, one on a
    main-queue victim shrinks it; 2%..90%, starting at 10%), so the second-sighting
    filter stops costing hits when reuse comes soon, and whose victims are taken
    leaf-first: when the queue picks a block that still has resident children, a
    leaf below it goes instead (a cached path from the last descent makes that
    O(1) amortised).

All calls are O(1) amortised (``leaf-lru``: O(log n)), pure Python.
"""

from __future__ import annotations

import abc
import heapq
from collections import OrderedDict
from collections.abc import Callable

from tierfs.errors import InvalidArgumentError

__all__ = [
    "ARCPolicy",
    "ChainPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "LeafLRUPolicy",
    "S3FifoPolicy",
    "make_policy",
    "policy_names",
]


class EvictionPolicy(abc.ABC):
    """What a KV tier asks of its eviction/admission policy.

    ``parent`` (in :meth:`on_insert`): pass it only where this owner would also
    hold the chain's previous block (a client tier holds whole chains; a target
    of a hashed KV pool holds one block in N of a chain and passes ``None``).
    """

    name: str = ""

    @abc.abstractmethod
    def on_insert(self, key: bytes, size: int, parent: bytes | None = None) -> None:
        """A new object is resident. ``parent``: the previous block of its prefix chain, if known.

        Inserting a key that is already resident counts as an access (its size is updated).
        """

    @abc.abstractmethod
    def on_access(self, key: bytes) -> None:
        """A hit on a resident object (unknown keys are ignored)."""

    @abc.abstractmethod
    def on_remove(self, key: bytes) -> None:
        """The owner removed the object (delete, TTL, pin, evicted by other means). Unknown keys are ignored."""

    @abc.abstractmethod
    def pop_victim(self) -> bytes | None:
        """Choose the next victim, forget it and return it; ``None`` when nothing is resident."""

    def admit(self, key: bytes, size: int) -> bool:
        """Should a new object be stored at all? The default admits everything."""
        return True

    def on_miss(self, key: bytes) -> None:  # noqa: B027 - optional hook, default does nothing
        """A lookup of ``key`` missed (admission sketches may count it)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of resident objects the policy tracks."""


class LRUPolicy(EvictionPolicy):
    """Least recently used: an ordered dict, oldest first."""

    name = "lru"

    def __init__(self) -> None:
        self._od: OrderedDict[bytes, None] = OrderedDict()

    def on_insert(self, key: bytes, size: int, parent: bytes | None = None) -> None:
        self._od[key] = None
        self._od.move_to_end(key)

    def on_access(self, key: bytes) -> None:
        if key in self._od:
            self._od.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._od.pop(key, None)

    def pop_victim(self) -> bytes | None:
        if not self._od:
            return None
        return self._od.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._od)



class _Chains:
    """Which resident blocks are parents of which resident blocks."""

    __slots__ = ("children", "parent_of")

    def __init__(self) -> None:
        self.parent_of: dict[bytes, bytes] = {}
        self.children: dict[bytes, set[bytes]] = {}

    def link(self, key: bytes, parent: bytes | None, resident: Callable[[bytes], bool]) -> None:
        # Only a resident parent is linked: a chain whose parent lives elsewhere (another
        # target, another tier) has nothing here to protect.
        if parent is not None and parent != key and resident(parent) and key not in self.parent_of:
            self.parent_of[key] = parent
            self.children.setdefault(parent, set()).add(key)

    def unlink(self, key: bytes) -> bytes | None:
        """Forget ``key``; its resident children become roots.

        Returns its parent when that just lost its last resident child (it is a leaf again).
        """
        for child in self.children.pop(key, ()):
            del self.parent_of[child]
        parent = self.parent_of.pop(key, None)
        if parent is None:
            return None
        siblings = self.children[parent]
        siblings.discard(key)
        if siblings:
            return None
        del self.children[parent]
        return parent

    def has_children(self, key: bytes) -> bool:
        return key in self.children


_ORPHAN = 1 << 62


class LeafLRUPolicy(EvictionPolicy):
    """LRU restricted to leaves of the prefix forest: a heap of (last access, key), lazily invalidated.

    An *orphan* (inserted with a parent this policy evicted recently) goes first:
    without its parent it cannot be a prefix hit.
    """

    name = "leaf-lru"

    def __init__(self) -> None:
        self._tick = 0
        self._stamp: dict[bytes, int] = {}
        self._heap: list[tuple[int, int, bytes]] = []
        self._chains = _Chains()
        self._gone: OrderedDict[bytes, None] = OrderedDict()  # recent victims, as many as resident
        # Keys pushed with a stamp get a unique sequence so tuples never compare keys (int
        # and bytes keys may not be mutually comparable).
        self._seq = 0

    def _push(self, key: bytes) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (self._stamp[key], self._seq, key))
        if len(self._heap) > 4 * len(self._stamp) + 64:
            # Every hit leaves a stale entry behind; without evictions to pop them the heap
            # would grow with the number of hits. Rebuilding from the live leaves is O(n)
            # once per 3n pushes.
            chains = self._chains
            self._heap = [
                (st, i, k) for i, (k, st) in enumerate(self._stamp.items()) if not chains.has_children(k)
            ]
            heapq.heapify(self._heap)

    def on_insert(self, key: bytes, size: int, parent: bytes | None = None) -> None:
        self._tick += 1
        orphan = parent is not None and parent not in self._stamp and parent in self._gone
        self._stamp[key] = self._tick - _ORPHAN if orphan else self._tick
        self._gone.pop(key, None)
        self._chains.link(key, parent, self._stamp.__contains__)
        if not self._chains.has_children(key):
            self._push(key)

    def on_access(self, key: bytes) -> None:
        if key not in self._stamp:
            return
        self._tick += 1
        self._stamp[key] = self._tick
        if not self._chains.has_children(key):
            self._push(key)

    def _forget(self, key: bytes) -> None:
        del self._stamp[key]
        freed = self._chains.unlink(key)
        if freed is not None and freed in self._stamp:
            self._push(freed)

    def on_remove(self, key: bytes) -> None:
        if key in self._stamp:
            self._forget(key)

    def pop_victim(self) -> bytes | None:
        heap = self._heap
        while heap:
            stamp, _, key = heapq.heappop(heap)
            if self._stamp.get(key) == stamp and not self._chains.has_children(key):
                self._forget(key)
                gone = self._gone
                gone[key] = None
                while len(gone) > max(len(self._stamp), 1):
                    gone.popitem(last=False)
                return key
        if self._stamp:
            # Unreachable while the chain links are consistent; kept so a policy bug can
            # never make a full cache refuse to evict.
            key = min(self._stamp, key=self._stamp.__getitem__)
            self._forget(key)
            return key
        return None

    def __len__(self) -> int:
        return len(self._stamp)



_SMALL, _MAIN = 0, 1


class S3FifoPolicy(EvictionPolicy):
    """S3-FIFO: small FIFO for new objects, main FIFO with reinsertion, ghost FIFO of recent small-queue victims.

    ``small_fraction`` of the resident bytes may sit in the small queue; an
    object hit at least ``promote_hits`` times while there moves to main. The
    ghost queue remembers as many keys as are resident. ``adaptive``: the small
    share moves with ghost hits (see ``chain``); ``leaf_first``: a victim with
    resident children is replaced by a leaf below it.
    """

    name = "s3fifo"
    _MAX_FREQ = 3

    def __init__(
        self,
        *,
        small_fraction: float = 0.1,
        promote_hits: int = 1,
        adaptive: bool = False,
        leaf_first: bool = False,
    ) -> None:
        if not 0.0 < small_fraction < 1.0:
            raise InvalidArgumentError(f"small_fraction must be in (0, 1), got {small_fraction}")
        self._small_fraction = small_fraction
        self._adaptive = adaptive
        self._chains: _Chains | None = _Chains() if leaf_first else None
        # Path from the last victim chosen by the queue down to the leaf evicted in its
        # place: evicting a subtree leaf by leaf costs O(1) each instead of O(depth).
        self._path: list[bytes] = []
        self._main_ghost: OrderedDict[bytes, None] = OrderedDict()
        self._promote_hits = promote_hits
        self._small: OrderedDict[bytes, None] = OrderedDict()
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._where: dict[bytes, int] = {}
        self._freq: dict[bytes, int] = {}
        self._size: dict[bytes, int] = {}
        self._small_bytes = 0
        self._bytes = 0

    def on_insert(self, key: bytes, size: int, parent: bytes | None = None) -> None:
        size = max(int(size), 1)
        if key in self._where:
            self._resize(key, size)
            self.on_access(key)
            return
        self._size[key] = size
        self._freq[key] = 0
        self._bytes += size
        if key in self._ghost:
            # Evicted from the small queue recently and back already: it is reused.
            del self._ghost[key]
            if self._adaptive:
                # ARC's rule: the small queue was too small to see this reuse.
                step = max(len(self._main_ghost) / max(len(self._ghost), 1), 1.0)
                self._small_fraction = min(0.9, self._small_fraction + step / max(len(self._where), 1))
            self._where[key] = _MAIN
            self._main[key] = None
        elif key in self._main_ghost:
            del self._main_ghost[key]
            if self._adaptive:
                step = max(len(self._ghost) / max(len(self._main_ghost), 1), 1.0)
                self._small_fraction = max(
                    0.02, self._small_fraction - step / max(len(self._where), 1)
                )
            self._where[key] = _MAIN
            self._main[key] = None
        else:
            self._where[key] = _SMALL
            self._small[key] = None
            self._small_bytes += size
        if self._chains is not None:
            if (
                parent is not None
                and parent not in self._where
                and (parent in self._ghost or parent in self._main_ghost)
            ):
                # An orphan: its parent was evicted here, so it cannot be a prefix hit
                # before that comes back. It waits at the head of the small queue.
                if self._where[key] == _MAIN:
                    del self._main[key]
                    self._where[key] = _SMALL
                    self._small_bytes += size
                self._small[key] = None
                self._small.move_to_end(key, last=False)
            self._chains.link(key, parent, self._where.__contains__)

    def _resize(self, key: bytes, size: int) -> None:
        delta = size - self._size[key]
        self._size[key] = size
        self._bytes += delta
        if self._where[key] == _SMALL:
            self._small_bytes += delta

    def on_access(self, key: bytes) -> None:
        f = self._freq.get(key)
        if f is not None and f < self._MAX_FREQ:
            self._freq[key] = f + 1

    def _drop(self, key: bytes) -> None:
        where = self._where.pop(key)
        size = self._size.pop(key)
        del self._freq[key]
        self._bytes -= size
        if where == _SMALL:
            del self._small[key]
            self._small_bytes -= size
        else:
            del self._main[key]
        if self._chains is not None:
            self._chains.unlink(key)

    def on_remove(self, key: bytes) -> None:
        if key in self._where:
            # The cached descent path holds only resident, linked keys; a removal by the
            # owner may cut it anywhere, so it is rebuilt on the next eviction.
            self._path.clear()
            self._drop(key)

    def _remember(self, key: bytes) -> None:
        ghost = self._ghost
        ghost[key] = None
        while len(ghost) > max(len(self._where), 1):
            ghost.popitem(last=False)

    def _leaf_under(self, key: bytes) -> bytes:
        """A resident leaf of ``key``'s subtree (``key`` itself when it has no resident children)."""
        chains = self._chains
        if chains is None or not chains.has_children(key):
            self._path.clear()
            return key
        path = self._path
        if not path or path[0] != key:
            path[:] = [key]
        # Resume where the last descent under this same key stopped. Only _evict (which
        # takes the path's own leaf) and on_remove (which clears the path) remove keys, so
        # every key on the path is still resident and linked to the one before it.
        node = path[-1]
        while chains.has_children(node):
            node = next(iter(chains.children[node]))
            path.append(node)
        path.pop()
        return node

    def _evict(self, key: bytes) -> bytes:
        """Evict ``key`` or, when it still has resident children, a leaf below it."""
        victim = self._leaf_under(key)
        in_small = self._where[victim] == _SMALL
        self._drop(victim)
        if in_small:
            self._remember(victim)
        elif self._adaptive or self._chains is not None:
            mg = self._main_ghost
            mg[victim] = None
            while len(mg) > max(len(self._where), 1):
                mg.popitem(last=False)
        return victim

    def _small_over(self) -> bool:
        return self._small_bytes > self._small_fraction * self._bytes

    def pop_victim(self) -> bytes | None:
        # Every object is looked at a bounded number of times (its frequency is capped and
        # decremented on each reinsertion), so the loop ends; the guard is a safety net.
        guard = 4 * (len(self._where) + 1) * (self._MAX_FREQ + 1)
        while self._where and guard > 0:
            guard -= 1
            if self._small and (self._small_over() or not self._main):
                key = next(iter(self._small))
                if self._freq[key] >= self._promote_hits:
                    self._small.pop(key)
                    self._small_bytes -= self._size[key]
                    self._where[key] = _MAIN
                    self._main[key] = None
                    self._freq[key] = 0
                    continue
                return self._evict(key)
            key = next(iter(self._main))
            if self._freq[key] > 0:
                self._freq[key] -= 1
                self._main.move_to_end(key)
                continue
            return self._evict(key)
        if self._where:
            key = next(iter(self._main or self._small))
            self._drop(key)
            return key
        return None

    def __len__(self) -> int:
        return len(self._where)



class ChainPolicy(S3FifoPolicy):
    """S3-FIFO with an adaptive small queue and leaf-first eviction of prefix chains.

    The recommended policy for prefix-reuse KV workloads: see the module docstring.
    """

    name = "chain"

    def __init__(self) -> None:
        super().__init__(adaptive=True, leaf_first=True)


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST'03), in entries.

    T1 holds objects seen once recently, T2 those seen at least twice; B1/B2 are
    ghosts of their recent victims. A ghost hit in B1 grows T1's target share
    ``p``, one in B2 shrinks it, so the split between recency and frequency follows
    the workload. The cache size ``c`` is the number of resident objects (the owner
    enforces capacity; at steady state that is the capacity).
    """

    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._p = 0.0
        self._c = 0

    def on_insert(self, key: bytes, size: int, parent: bytes | None = None) -> None:
        if key in self._t1 or key in self._t2:
            self.on_access(key)
            return
        self._c = max(self._c, len(self._t1) + len(self._t2) + 1)
        if key in self._b1:
            self._p = min(float(self._c), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = max(self._c, 1)
        while len(self._t1) + len(self._b1) > c and self._b1:
            self._b1.popitem(last=False)
        while len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c and self._b2:
            self._b2.popitem(last=False)

    def on_access(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def pop_victim(self) -> bytes | None:
        if self._t1 and (len(self._t1) > self._p or not self._t2):
            key = self._t1.popitem(last=False)[0]
            self._b1[key] = None
        elif self._t2:
            key = self._t2.popitem(last=False)[0]
            self._b2[key] = None
        else:
            return None
        self._trim_ghosts()
        return key

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


_FACTORIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": lambda _cap: LRUPolicy(),
    "leaf-lru": lambda _cap: LeafLRUPolicy(),
    "s3fifo": lambda _cap: S3FifoPolicy(),
    "arc": lambda _cap: ARCPolicy(),
    "chain": lambda _cap: ChainPolicy(),
}


def policy_names() -> list[str]:
    """Names :func:`make_policy` accepts, baseline first."""
    return list(_FACTORIES)


def make_policy(name: str, *, capacity_bytes: int = 0) -> EvictionPolicy:
    """A fresh policy by name. ``capacity_bytes`` is a sizing hint only; the owner enforces capacity."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise InvalidArgumentError(f"unknown eviction policy {name!r}; known: {', '.join(_FACTORIES)}")
    if capacity_bytes < 0:
        raise InvalidArgumentError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
    return factory(capacity_bytes)
