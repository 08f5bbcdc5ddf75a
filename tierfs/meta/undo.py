"""Undo log for the meta state machine: a failing op leaves the state exactly
as it was.

:meth:`tierfs.meta.state.MetaStateMachine.apply` runs every op inside
:func:`transaction`. While one is open, every mutation of a *tracked*
container or object appends its inverse to the open :class:`UndoLog`; if the
op raises (a ``TierFSError`` decided half-way, or a bug), :meth:`UndoLog.rollback`
replays the inverses newest first, so the state - clock and counters included
- is byte for byte what it was, on every replica alike. On success the log is
dropped (cost: one list append per mutation).

The rule for new state (what the namespace, session, GC, ... code must follow
to be covered):

* every mutable container reachable from the state machine is a
  :class:`TDict`, :class:`TSet` or :class:`TList`. Plain ``dict``/``set``/
  ``list`` values (also inside tuples) are converted automatically when
  stored into a tracked container or assigned to an attribute of a tracked
  object, so ``d.setdefault(k, set()).add(x)`` and
  ``self.requests[c] = (now, {})`` are covered; a plain container that is
  kept in a local variable *and* mutated after being stored is not (use the
  value the container returns, e.g. ``setdefault``'s);
* every mutable record class (dataclass) reachable from the state derives
  from :class:`Tracked` (``@dataclass(slots=True) class X(Tracked)``: the
  mixin has empty ``__slots__``); attribute assignment is then recorded;
* immutable values (int, str, bytes, tuples of those, frozen dataclasses such
  as ``LayoutSpec`` and ``ChunkRecord``) need nothing;
* a structure with indexes of its own may instead undo at the level of its
  operations with :func:`record` (``GCQueue`` puts each entry it touches back
  whole). The dedup table (``RequestTable``) is changed only after an op has
  succeeded, so it needs neither;
* the state machine itself derives from :class:`Tracked`, so plain
  attributes (``self.clock``, ``self.next_inode``, a new container assigned
  with ``self.x = {}``) are covered too.

Mutations outside a transaction (``restore``, construction) record nothing.
Only :func:`transaction` on the event-loop thread opens a log; there is at
most one open at a time (not thread-safe, by design: the state machine is
applied on one thread).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, SupportsIndex, TypeVar

__all__ = ["TDict", "TList", "TSet", "Tracked", "UndoLog", "new_object", "record", "track", "transaction"]

K = TypeVar("K")
T = TypeVar("T")
V = TypeVar("V")

_MISSING: Any = object()


class UndoLog:
    """Inverse actions of the mutations made since it was opened."""

    __slots__ = ("_actions",)

    def __init__(self) -> None:
        self._actions: list[Callable[[], None]] = []

    def record(self, undo: Callable[[], None]) -> None:
        self._actions.append(undo)

    def __len__(self) -> int:
        return len(self._actions)

    def rollback(self) -> None:
        """Undo everything recorded, newest first (nothing is recorded while
        undoing: the log is closed by then)."""
        actions, self._actions = self._actions, []
        for undo in reversed(actions):
            undo()


_current: UndoLog | None = None


@contextmanager
def transaction() -> Iterator[UndoLog]:
    """Record undo actions while the block runs; roll back if it raises."""
    global _current
    if _current is not None:
        raise RuntimeError("undo transactions do not nest")
    log = UndoLog()
    _current = log
    try:
        yield log
    except BaseException:
        _current = None
        log.rollback()
        raise
    finally:
        _current = None


def record(undo: Callable[[], None]) -> None:
    """Add ``undo`` to the open log (nothing outside a transaction): for a
    structure that undoes its own changes at its operations' level rather
    than through tracked containers (the GC queue's indexes)."""
    if _current is not None:
        _current.record(undo)


def new_object(make: Callable[[], T]) -> T:
    """``make()`` without recording the attribute assignments of the object
    it constructs. Only for a *new* object: until it is stored into the state
    nothing can reach it, and storing it (into a tracked container) is
    recorded as usual, so a rollback drops it whole. Recording each field
    its ``__init__`` sets (an inode has 17) was most of the undo log's cost
    per create."""
    global _current
    saved, _current = _current, None
    try:
        return make()
    finally:
        _current = saved


def track(value: Any) -> Any:
    """A tracked equivalent of ``value`` (plain dict/set/list converted,
    recursively, also inside tuples); anything else is returned as is."""
    t = type(value)
    if t is dict:
        return TDict(value)
    if t is set:
        return TSet(value)
    if t is list:
        return TList(value)
    if t is tuple and any(type(v) in (dict, set, list, tuple) for v in value):
        return tuple(track(v) for v in value)
    return value


class TDict(dict[K, V]):
    """A dict whose mutations are undone by the open :class:`UndoLog`."""

    __slots__ = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        for k, v in dict(*args, **kwargs).items():
            dict.__setitem__(self, k, track(v))

    def _undo_key(self, key: Any) -> None:
        log = _current
        if log is None:
            return
        old = dict.get(self, key, _MISSING)
        if old is _MISSING:
            log.record(lambda: self._drop(key))
        else:
            log.record(lambda: dict.__setitem__(self, key, old))

    def _drop(self, key: Any) -> None:
        dict.pop(self, key, None)

    def __setitem__(self, key: K, value: V) -> None:
        self._undo_key(key)
        dict.__setitem__(self, key, track(value))

    def __delitem__(self, key: K) -> None:
        if key in self:
            self._undo_key(key)
        dict.__delitem__(self, key)

    def pop(self, key: K, *default: Any) -> Any:
        if key in self:
            self._undo_key(key)
        return dict.pop(self, key, *default)

    def popitem(self) -> tuple[K, V]:
        k, v = dict.popitem(self)
        if _current is not None:
            _current.record(lambda: dict.__setitem__(self, k, v))
        return k, v

    def setdefault(self, key: K, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    def clear(self) -> None:
        if _current is not None:
            saved = dict(self)
            _current.record(lambda: dict.update(self, saved))
        dict.clear(self)

    def __ior__(self, other: Any) -> TDict[K, V]:  # type: ignore[override,misc]
        self.update(other)
        return self

    def copy(self) -> dict[K, V]:
        """A plain (untracked) shallow copy."""
        return dict(self)


class TSet(set[V]):
    """A set whose mutations are undone by the open :class:`UndoLog`."""

    __slots__ = ()

    def add(self, value: V) -> None:
        if _current is not None and value not in self:
            _current.record(lambda: set.discard(self, value))
        set.add(self, value)

    def discard(self, value: Any) -> None:
        if _current is not None and value in self:
            _current.record(lambda: set.add(self, value))
        set.discard(self, value)

    def remove(self, value: Any) -> None:
        if value not in self:
            raise KeyError(value)
        self.discard(value)

    def pop(self) -> V:
        v = set.pop(self)
        if _current is not None:
            _current.record(lambda: set.add(self, v))
        return v

    def clear(self) -> None:
        if _current is not None:
            saved = set(self)
            _current.record(lambda: set.update(self, saved))
        set.clear(self)

    def update(self, *others: Iterable[V]) -> None:
        for it in others:
            for v in it:
                self.add(v)

    def difference_update(self, *others: Iterable[Any]) -> None:
        for it in others:
            for v in list(it):
                self.discard(v)

    def intersection_update(self, *others: Iterable[Any]) -> None:
        keep = set(self).intersection(*others)
        for v in list(self):
            if v not in keep:
                self.discard(v)

    def symmetric_difference_update(self, other: Iterable[V]) -> None:
        for v in set(other):
            if v in self:
                self.discard(v)
            else:
                self.add(v)

    def __ior__(self, other: Any) -> TSet[V]:  # type: ignore[override,misc]
        self.update(other)
        return self

    def __iand__(self, other: Any) -> TSet[V]:  # type: ignore[override,misc]
        self.intersection_update(other)
        return self

    def __isub__(self, other: Any) -> TSet[V]:  # type: ignore[override,misc]
        self.difference_update(other)
        return self

    def __ixor__(self, other: Any) -> TSet[V]:  # type: ignore[override,misc]
        self.symmetric_difference_update(other)
        return self

    def copy(self) -> set[V]:
        """A plain (untracked) shallow copy."""
        return set(self)


class TList(list[V]):
    """A list whose mutations are undone by the open :class:`UndoLog`.
    Every mutation saves the whole list (lists in the state are short:
    group members, a node's targets, a file's groups)."""

    __slots__ = ()

    def __init__(self, items: Iterable[V] = ()) -> None:
        super().__init__(track(v) for v in items)

    def _save(self) -> None:
        if _current is not None:
            saved = list(self)
            _current.record(lambda: list.__setitem__(self, slice(None), saved))

    def __setitem__(self, index: Any, value: Any) -> None:
        self._save()
        if isinstance(index, slice):
            list.__setitem__(self, index, [track(v) for v in value])
        else:
            list.__setitem__(self, index, track(value))

    def __delitem__(self, index: Any) -> None:
        self._save()
        list.__delitem__(self, index)

    def append(self, value: V) -> None:
        self._save()
        list.append(self, track(value))

    def extend(self, values: Iterable[V]) -> None:
        self._save()
        list.extend(self, [track(v) for v in values])

    def insert(self, index: SupportsIndex, value: V) -> None:
        self._save()
        list.insert(self, index, track(value))

    def pop(self, index: SupportsIndex = -1) -> V:
        self._save()
        return list.pop(self, index)

    def remove(self, value: V) -> None:
        self._save()
        list.remove(self, value)

    def clear(self) -> None:
        self._save()
        list.clear(self)

    def sort(self, *args: Any, **kwargs: Any) -> None:
        self._save()
        list.sort(self, *args, **kwargs)

    def reverse(self) -> None:
        self._save()
        list.reverse(self)

    def __iadd__(self, values: Iterable[V]) -> TList[V]:  # type: ignore[override,misc]
        self.extend(values)
        return self

    def __imul__(self, n: SupportsIndex) -> TList[V]:
        self._save()
        list.__imul__(self, n)
        return self

    def copy(self) -> list[V]:
        """A plain (untracked) shallow copy."""
        return list(self)


class Tracked:
    """Mixin: attribute assignments are undone by the open :class:`UndoLog`,
    and plain containers assigned are converted to tracked ones. Works with
    ``@dataclass(slots=True)`` (it has no slots of its own)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        log = _current
        if log is not None:
            old = getattr(self, name, _MISSING)
            if old is _MISSING:
                log.record(lambda: object.__delattr__(self, name))
            else:
                log.record(lambda: object.__setattr__(self, name, old))
        object.__setattr__(self, name, track(value))

    def __delattr__(self, name: str) -> None:
        log = _current
        if log is not None:
            old = getattr(self, name)
            log.record(lambda: object.__setattr__(self, name, old))
        object.__delattr__(self, name)
