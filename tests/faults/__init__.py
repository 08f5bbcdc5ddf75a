"""Fault injection for TierFS tests: LazyFS, a power-loss simulating FUSE mount."""

from .lazyfs import LazyFS, LazyFSError

__all__ = ["LazyFS", "LazyFSError"]
