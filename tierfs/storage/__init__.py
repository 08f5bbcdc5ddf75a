"""Storage daemon: chunk engine, I/O backends, data-plane server, repair and scrub.

The data plane talks to a target through :class:`FragmentStore`;
:class:`ChunkEngine` is the on-disk implementation (one per target), doing
its disk I/O through an :class:`IOBackend` (io_uring or posix threads) with
buffers from :class:`tierfs.buffers.BufferPool`. ``tierfs-storage`` is
:mod:`tierfs.storage.daemon`.
"""

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
