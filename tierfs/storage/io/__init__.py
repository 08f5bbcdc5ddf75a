"""Disk I/O backends: io_uring (preferred) and posix threads, behind one ABC.

``open_backend(kind, pool, ...)`` picks one: ``"auto"`` probes io_uring once
and falls back to posix with a logged reason; ``"uring"`` insists (and fails
with ConfigError when the kernel refuses); ``"posix"`` never tries io_uring.
"""

from __future__ import annotations

import logging

from tierfs.buffers import BufferPool
from tierfs.errors import ConfigError
from tierfs.storage.io.base import IOBackend
from tierfs.storage.io.posix import PosixBackend
from tierfs.storage.io.uring import UringBackend, probe_uring

__all__ = ["BACKENDS", "IOBackend", "PosixBackend", "UringBackend", "open_backend", "probe_uring"]

BACKENDS = ("auto", "uring", "posix")

log = logging.getLogger(__name__)
_probe_result: list[str | None] = []


def _uring_unavailable() -> str | None:
    if not _probe_result:
        _probe_result.append(probe_uring())
    return _probe_result[0]


def open_backend(kind: str, pool: BufferPool, *, queue_depth: int = 64, threads: int = 8) -> IOBackend:
    """Build the backend ``kind`` names ("auto" | "uring" | "posix")."""
    if kind not in BACKENDS:
        raise ConfigError(f"unknown I/O backend {kind!r} (one of {', '.join(BACKENDS)})", field="io_backend")
    if kind in ("auto", "uring"):
        reason = _uring_unavailable()
        if reason is None:
            try:
                return UringBackend(pool, queue_depth=queue_depth)
            except OSError as exc:  # e.g. a deeper ring than the probe's hits RLIMIT_MEMLOCK
                reason = f"ring of depth {queue_depth}: {exc}"
        if kind == "uring":
            raise ConfigError(f"io_uring unavailable: {reason}", field="io_backend")
        log.warning("io_uring unavailable (%s); using the posix backend", reason)
    return PosixBackend(pool, threads=threads)
