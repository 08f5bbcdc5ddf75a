"""The GC queue of the meta state machine: fragments waiting to be deleted.

An item is one old chunk version in one placement group, with the targets
that still hold a fragment of it (and the fragment index on each). Items are
indexed by id and, per target, by the ids still pending there, so a storage
node's ``ListGC`` page costs O(page + log n) whatever the length of the
queue, and an ``AckGC`` O(log n).

Every item carries a *ready* time: the state clock when it was queued plus the
GC grace the op carried (``MetaOp.gc_grace_ms``). ``ListGC`` lists only ready
items, so readers that opened a file before an overwrite can finish reading
the old generation. Ready times never decrease along the queue (an item is
ready no earlier than the one queued before it): a page then simply stops at
the first item that is not ready yet. Lowering the grace therefore takes
effect once the items queued under the old grace are ready.

Everything here is deterministic (no clocks; iteration in id order), as the
state machine requires.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tierfs.meta.undo import record

__all__ = ["GCEntry", "GCQueue"]

_BLOCK = 256


@dataclass(slots=True)
class GCEntry:
    id: int
    inode: int
    chunk: int
    version: int
    group: int
    pending: dict[int, int] = field(default_factory=dict)  # target id -> fragment index
    ready: int = 0  # state clock (ns) from which ListGC lists it


def _first(block: list[int]) -> int:
    return block[0]


class _Ids:
    """A sorted set of ints that only ever grows at its top (GC ids are
    allocated in increasing order): blocks of at most ``_BLOCK`` sorted ids.
    Seek and removal are O(log n) plus O(block); a block emptied by removals
    is dropped."""

    __slots__ = ("_blocks", "_len")

    def __init__(self) -> None:
        self._blocks: list[list[int]] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def insert(self, i: int) -> None:
        """Put ``i`` back anywhere in order (undo of a removal)."""
        blocks = self._blocks
        k = bisect_right(blocks, i, key=_first) - 1
        if k < 0:
            if blocks:
                blocks[0].insert(0, i)
            else:
                blocks.append([i])
        else:
            block = blocks[k]
            j = bisect_left(block, i)
            if j < len(block) and block[j] == i:
                return
            block.insert(j, i)
        self._len += 1

    def add(self, i: int) -> None:
        blocks = self._blocks
        if blocks and blocks[-1][-1] >= i:
            raise ValueError(f"gc id {i} is not above the last one ({blocks[-1][-1]})")
        if not blocks or len(blocks[-1]) >= _BLOCK:
            blocks.append([i])
        else:
            blocks[-1].append(i)
        self._len += 1

    def discard(self, i: int) -> None:
        blocks = self._blocks
        k = bisect_right(blocks, i, key=_first) - 1
        if k < 0:
            return
        block = blocks[k]
        j = bisect_left(block, i)
        if j < len(block) and block[j] == i:
            del block[j]
            self._len -= 1
            if not block:
                del blocks[k]

    def last(self) -> int:
        return self._blocks[-1][-1] if self._blocks else 0

    def after(self, i: int) -> Iterator[int]:
        """Ids above ``i`` in increasing order (do not modify while iterating)."""
        blocks = self._blocks
        k = max(0, bisect_right(blocks, i, key=_first) - 1)
        for b in range(k, len(blocks)):
            block = blocks[b]
            for j in range(bisect_right(block, i) if b == k else 0, len(block)):
                yield block[j]


class GCQueue:
    """The items by id, all ids in order, and per target the ids pending there."""

    def __init__(self) -> None:
        self._items: dict[int, GCEntry] = {}
        self._all = _Ids()
        self._by_target: dict[int, _Ids] = {}

    # ---- read-only mapping view (tests, diagnostics) ----------------------------

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)

    def get(self, item_id: int) -> GCEntry | None:
        return self._items.get(item_id)

    def values(self) -> Iterable[GCEntry]:
        return self._items.values()

    def pending_on(self, target_id: int) -> int:
        """How many items still wait for ``target_id``."""
        ids = self._by_target.get(target_id)
        return len(ids) if ids is not None else 0

    # ---- changes ----------------------------------------------------------------

    def last_ready(self) -> int:
        """Ready time of the newest item (0 when empty): the floor of the next one."""
        last = self._all.last()
        return self._items[last].ready if last else 0

    def add(self, entry: GCEntry) -> None:
        """Queue ``entry`` (its id above every id queued before; its ready time
        raised to the newest item's if lower). An entry no target holds is
        not queued."""
        if not entry.pending:
            return
        self._undo_point(entry.id)
        entry.ready = max(entry.ready, self.last_ready())
        self._all.add(entry.id)
        self._items[entry.id] = entry
        for t in entry.pending:
            ids = self._by_target.get(t)
            if ids is None:
                ids = self._by_target[t] = _Ids()
            ids.add(entry.id)

    def ack(self, item_id: int, target_id: int) -> bool:
        """``target_id`` deleted its fragment of item ``item_id``; False if it
        was not pending there (unknown or already acknowledged)."""
        item = self._items.get(item_id)
        if item is None or target_id not in item.pending:
            return False
        self._undo_point(item_id)
        del item.pending[target_id]
        self._unindex(target_id, item_id)
        if not item.pending:
            self._remove(item_id)
        return True

    def add_copies(self, source: int, group: int, target: int, fragment: int) -> int:
        """``target`` now holds, at position ``fragment`` of ``group``, what
        ``source`` held there (a move's copy): name it in every item of the
        group still pending on ``source`` at that position. Returns how many
        items. O(items pending on ``source``)."""
        ids = self._by_target.get(source)
        if ids is None:
            return 0
        n = 0
        for item_id in list(ids.after(0)):
            item = self._items[item_id]
            if item.group != group or item.pending.get(source) != fragment or target in item.pending:
                continue
            self._undo_point(item_id)
            item.pending[target] = fragment
            mine = self._by_target.get(target)
            if mine is None:
                mine = self._by_target[target] = _Ids()
            mine.insert(item_id)
            n += 1
        return n

    def drop_targets(self, target_ids: Iterable[int]) -> None:
        """Forget what ``target_ids`` still had to delete (they are gone)."""
        for t in sorted(set(target_ids)):
            ids = self._by_target.pop(t, None)
            if ids is None:
                continue
            for item_id in list(ids.after(0)):
                self._undo_point(item_id)
                item = self._items[item_id]
                del item.pending[t]
                if not item.pending:
                    self._remove(item_id)

    def _undo_point(self, item_id: int) -> None:
        """Record, in the meta op's open undo log (tierfs.meta.undo), how to put
        item ``item_id`` back exactly as it is now (or absent), indexes
        included. Entries are restored whole, so the undo of any sequence of
        changes, replayed newest first, ends where it began."""
        cur = self._items.get(item_id)
        saved = None if cur is None else GCEntry(cur.id, cur.inode, cur.chunk, cur.version, cur.group,
                                                  dict(cur.pending), cur.ready)
        record(lambda: self._put_back(item_id, saved))

    def _put_back(self, item_id: int, saved: GCEntry | None) -> None:
        cur = self._items.pop(item_id, None)
        if cur is not None:
            self._all.discard(item_id)
            for t in cur.pending:
                ids = self._by_target.get(t)
                if ids is not None:
                    ids.discard(item_id)
                    if not len(ids):
                        del self._by_target[t]
        if saved is None:
            return
        self._items[item_id] = saved
        self._all.insert(item_id)
        for t in saved.pending:
            ids = self._by_target.get(t)
            if ids is None:
                ids = self._by_target[t] = _Ids()
            ids.insert(item_id)

    def _unindex(self, target_id: int, item_id: int) -> None:
        ids = self._by_target[target_id]
        ids.discard(item_id)
        if not len(ids):
            del self._by_target[target_id]

    def _remove(self, item_id: int) -> None:
        del self._items[item_id]
        self._all.discard(item_id)

    # ---- reads ------------------------------------------------------------------

    def page(self, target_ids: Iterable[int], after_id: int, limit: int, now: int) -> list[tuple[GCEntry, int]]:
        """Rows ``(item, target)`` of ready items (``ready <= now``) with id
        above ``after_id``, in (id, target) order, for ``target_ids`` (every
        target when empty). A page holds at least ``limit`` rows unless the
        queue ends, and never splits an item's rows (the caller pages on by
        the last item id)."""
        want = sorted(set(target_ids))
        rows: list[tuple[GCEntry, int]] = []
        items = self._items
        if not want:
            for item_id in self._all.after(after_id):
                item = items[item_id]
                if item.ready > now or len(rows) >= limit:
                    break
                rows.extend((item, t) for t in sorted(item.pending))
            return rows

        def ready_ids(t: int, ids: _Ids) -> Iterator[tuple[int, int]]:
            for item_id in ids.after(after_id):
                if items[item_id].ready > now:
                    return
                yield item_id, t

        streams = [ready_ids(t, self._by_target[t]) for t in want if t in self._by_target]
        last = -1
        for item_id, t in heapq.merge(*streams):
            if len(rows) >= limit and item_id != last:
                break
            rows.append((items[item_id], t))
            last = item_id
        return rows

    def waiting(self, target_id: int, group: int, after_id: int, limit: int, now: int) -> list[GCEntry]:
        """Items of ``group`` still pending on ``target_id`` and not ready at
        ``now`` (their GC grace runs: readers may still read them), id above
        ``after_id``, in id order, at most ``limit``. Ready times never fall
        as ids rise, so the ready ones are skipped from the front."""
        ids = self._by_target.get(target_id)
        if ids is None:
            return []
        out: list[GCEntry] = []
        for item_id in ids.after(after_id):
            item = self._items[item_id]
            if item.ready <= now or item.group != group:
                continue
            out.append(item)
            if len(out) >= limit:
                break
        return out

    def after(self, after_id: int) -> Iterator[GCEntry]:
        """Every item with id above ``after_id``, in id order."""
        for item_id in self._all.after(after_id):
            yield self._items[item_id]

    # ---- snapshot encoding -----------------------------------------------------------

    def to_json(self) -> list[list[Any]]:
        return [[e.id, e.inode, e.chunk, e.version, e.group, sorted([t, f] for t, f in e.pending.items()), e.ready]
                for e in (self._items[i] for i in self._all.after(0))]

    @classmethod
    def from_json(cls, doc: list[list[Any]]) -> GCQueue:
        """Rebuild from :meth:`to_json`; entries of snapshots older than
        ready times (six fields) are ready at once, as they were then."""
        q = cls()
        for e in sorted(doc, key=lambda e: int(e[0])):
            q.add(GCEntry(id=e[0], inode=e[1], chunk=e[2], version=e[3], group=e[4],
                          pending={t: f for t, f in e[5]}, ready=e[6] if len(e) > 6 else 0))
        return q
