"""Eviction and admission policies for the KV tiers and the per-target KV store.

Placeholder holding only the shared interface and LRU (the policy piece of
issue 9 provides the full module; this one keeps the same names and
signatures so the tiers can be built and tested against it).
"""

from __future__ import annotations

import abc
from collections import OrderedDict

__all__ = ["EvictionPolicy", "LRUPolicy", "make_policy", "policy_names"]


class EvictionPolicy(abc.ABC):
    """Chooses victims among the resident objects of one owner (a tier or a pool)."""

    name: str = ""

    @abc.abstractmethod
    def on_insert(self, key: bytes, size: int, parent: bytes | None = None) -> None:
        """A new object is resident (``parent``: the previous block of its prefix chain)."""

    @abc.abstractmethod
    def on_access(self, key: bytes) -> None:
        """A hit on a resident object."""

    @abc.abstractmethod
    def on_remove(self, key: bytes) -> None:
        """The owner removed ``key`` (delete, TTL, pin); unknown keys are ignored."""

    @abc.abstractmethod
    def pop_victim(self) -> bytes | None:
        """Choose the next victim, forget it and return it; None when empty."""

    def admit(self, key: bytes, size: int) -> bool:
        """Whether to store a new object at all."""
        return True

    def on_miss(self, key: bytes) -> None:
        """A lookup missed (admission sketches may count it)."""
        return None

    @abc.abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used: the baseline."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, int] = OrderedDict()

    def on_insert(self, key: bytes, size: int, parent: bytes | None = None) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def on_access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def pop_victim(self) -> bytes | None:
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)


_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}


def policy_names() -> list[str]:
    return sorted(_POLICIES)


def make_policy(name: str, *, capacity_bytes: int = 0) -> EvictionPolicy:
    """A fresh policy instance by name."""
    cls = _POLICIES.get(name)
    if cls is None:
        from tierfs.errors import InvalidArgumentError

        raise InvalidArgumentError(f"unknown eviction policy {name!r} (one of {', '.join(policy_names())})")
    return cls()
