"""Storage daemon: chunk engine, I/O backends, data-plane server, repair and scrub.

The data plane talks to a target through :class:`FragmentStore`;
:class:`ChunkEngine` is the on-disk implementation (one per target), doing
its disk I/O through an :class:`IOBackend` (io_uring or posix threads) with
buffers from :class:`tierfs.buffers.BufferPool`. ``tierfs-storage`` is
:mod:`tierfs.storage.daemon`.

The names below are loaded on first use (PEP 562): a client that needs only
:mod:`tierfs.storage.api` does not import the engine, repair and scrub.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierfs.storage.api import FragmentInfo, FragmentKey, FragmentStore
    from tierfs.storage.config import StorageConfig
    from tierfs.storage.engine import ChunkEngine, TargetState, TargetStats, crc32c
    from tierfs.storage.io import IOBackend, PosixBackend, UringBackend, open_backend, probe_uring
    from tierfs.storage.repair import RateLimiter, Repairer
    from tierfs.storage.scrub import Scrubber, ScrubReport

__all__ = [
    "ChunkEngine",
    "FragmentInfo",
    "FragmentKey",
    "FragmentStore",
    "IOBackend",
    "PosixBackend",
    "RateLimiter",
    "Repairer",
    "ScrubReport",
    "Scrubber",
    "StorageConfig",
    "TargetState",
    "TargetStats",
    "UringBackend",
    "crc32c",
    "open_backend",
    "probe_uring",
]

_WHERE = {
    "FragmentInfo": "tierfs.storage.api", "FragmentKey": "tierfs.storage.api", "FragmentStore": "tierfs.storage.api",
    "StorageConfig": "tierfs.storage.config",
    "ChunkEngine": "tierfs.storage.engine", "TargetState": "tierfs.storage.engine", "TargetStats": "tierfs.storage.engine", "crc32c": "tierfs.storage.engine",
    "IOBackend": "tierfs.storage.io", "PosixBackend": "tierfs.storage.io", "UringBackend": "tierfs.storage.io", "open_backend": "tierfs.storage.io", "probe_uring": "tierfs.storage.io",
    "RateLimiter": "tierfs.storage.repair", "Repairer": "tierfs.storage.repair",
    "Scrubber": "tierfs.storage.scrub", "ScrubReport": "tierfs.storage.scrub",
}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'tierfs.storage' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
