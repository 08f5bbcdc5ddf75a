"""Helpers for the client SDK tests: real local clusters (3 meta replicas
and N storage daemons as processes on loopback, ``tierfs.local``)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from tierfs.local import LocalCluster

__all__ = ["digest", "random_bytes", "start_cluster"]


def start_cluster(path: Path, n_storage: int = 6) -> LocalCluster:
    cl = LocalCluster(path, n_storage=n_storage)
    cl.up(timeout=90)
    return cl


def digest(data: Any) -> str:
    """sha256 of any buffer (bytes, memoryview, numpy array)."""
    return hashlib.sha256(data).hexdigest()


def random_bytes(n: int, seed: int) -> bytes:
    """Deterministic pseudo-random bytes (fast for large n)."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
