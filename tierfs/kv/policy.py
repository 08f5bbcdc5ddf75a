"""Eviction and admission policies for the KV tiers and the per-target KV store.

Placeholder holding only the shared interface and LRU (the policy piece of
issue 9 provides the full module with the same names and signatures; the
per-target KV store is built and tested against this one).
"""

from __future__ import annotations

import abc
from collections import OrderedDict

from tierfs.errors import InvalidArgumentError

__all__ = ["EvictionPolicy", "LRUPolicy", "make_policy", "policy_names"]


class EvictionPolicy(abc.ABC):
    """What a KV tier asks of its eviction/admission policy. Pinned objects are
    not in the policy at all (the owner removes them at pin and re-inserts them
    at unpin), so a victim is always evictable."""

    name: str = ""

    @abc.abstractmethod
    def on_insert(self, key: bytes, size: int, parent: bytes | None = None) -> None:
        """A new object is resident (``parent``: the previous block of its prefix chain)."""

    @abc.abstractmethod
    def on_access(self, key: bytes) -> None:
        """A hit on a resident object (unknown keys are ignored)."""

    @abc.abstractmethod
    def on_remove(self, key: bytes) -> None:
        """The owner removed the object (unknown keys are ignored)."""

    @abc.abstractmethod
    def pop_victim(self) -> bytes | None:
        """Choose the next victim, forget it and return it; None when empty."""

    def admit(self, key: bytes, size: int) -> bool:
        """Should a new object be stored at all? The default admits everything."""
        return True

    def on_miss(self, key: bytes) -> None:  # noqa: B027 - optional hook
        """A lookup of ``key`` missed."""

    @abc.abstractmethod
    def __len__(self) -> int: ...


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


def policy_names() -> list[str]:
    return ["lru"]


def make_policy(name: str, *, capacity_bytes: int = 0) -> EvictionPolicy:
    """A fresh policy by name (``capacity_bytes`` is a sizing hint only)."""
    if name != "lru":
        raise InvalidArgumentError(f"unknown KV policy {name!r}; known: {', '.join(policy_names())}")
    if capacity_bytes < 0:
        raise InvalidArgumentError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
    return LRUPolicy()
