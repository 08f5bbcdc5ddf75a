"""A FUSE mount of TierFS (``tierfs mount``): pyfuse3 on the asyncio loop of
an ``AsyncClient``. See docs/fuse.md."""

from tierfs.fuse.mount import FUSE_TYPE, MountConfig, MountError, find_mount, mount, unmount

__all__ = ["FUSE_TYPE", "MountConfig", "MountError", "find_mount", "mount", "unmount"]
