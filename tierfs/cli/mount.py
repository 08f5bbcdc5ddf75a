"""``tierfs mount MOUNTPOINT`` and ``tierfs umount MOUNTPOINT`` (the FUSE
mount, :mod:`tierfs.fuse`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from tierfs.cli.util import parse_seconds_or_zero

__all__ = ["add_commands", "execute"]


def add_commands(cmd: Callable[..., argparse.ArgumentParser]) -> None:
    p = cmd("mount", "mount TierFS at a directory (FUSE); a daemon unless --foreground")
    p.add_argument("mountpoint")
    p.add_argument("-f", "--foreground", action="store_true", help="serve in the foreground until unmounted")
    p.add_argument("--allow-other", action="store_true", help="let other users use the mount (FUSE allow_other)")
    p.add_argument("--attr-timeout", type=parse_seconds_or_zero, default=1.0, metavar="SECONDS",
                   help="how long the kernel caches attributes (default 1; 0: ask meta every time)")
    p.add_argument("--entry-timeout", type=parse_seconds_or_zero, default=1.0, metavar="SECONDS",
                   help="how long the kernel caches name lookups (default 1)")
    p.add_argument("--read-ahead", type=int, default=4096, metavar="KiB",
                   help="kernel read-ahead of the mount (default 4096)")
    p.add_argument("--max-tasks", type=int, default=64, metavar="N", help="FUSE requests served at once")
    p.add_argument("--log", default=None, metavar="FILE", help="log here (daemon: otherwise nowhere)")
    p.add_argument("--debug", action="store_true", help="log every FUSE request (with --log or --foreground)")
    p = cmd("umount", "unmount a TierFS mount (fusermount3 -u)", meta=False)
    p.add_argument("mountpoint")
    p.add_argument("-z", "--lazy", action="store_true", help="detach now even if files are open there")


def execute(ns: argparse.Namespace, env: Mapping[str, str], resolve: Callable[[], list[str]],
            emit: Callable[[Any, str | None], None]) -> int | None:
    """Run ``ns`` if it is one of this module's commands; its exit code (None: not ours)."""
    from tierfs.fuse import MountConfig, mount, unmount

    if ns.cmd == "mount":
        if ns.attr_timeout < 0 or ns.entry_timeout < 0 or ns.read_ahead < 0 or ns.max_tasks < 1:
            from tierfs.errors import InvalidArgumentError

            raise InvalidArgumentError("timeouts and --read-ahead must be >= 0, --max-tasks >= 1")
        cfg = MountConfig(mountpoint=ns.mountpoint, meta=resolve(), allow_other=ns.allow_other,
                          attr_timeout=ns.attr_timeout, entry_timeout=ns.entry_timeout,
                          read_ahead_kib=ns.read_ahead, timeout=ns.timeout, max_tasks=ns.max_tasks,
                          log_file=ns.log, debug=ns.debug)
        mount(cfg, foreground=ns.foreground)
        if not ns.foreground:
            emit({"mountpoint": ns.mountpoint, "mounted": True},
                 f"mounted TierFS at {ns.mountpoint}; unmount with: tierfs umount {ns.mountpoint}")
        return 0
    if ns.cmd == "umount":
        unmount(ns.mountpoint, lazy=ns.lazy, timeout=ns.timeout)
        emit({"mountpoint": ns.mountpoint, "mounted": False}, f"unmounted {ns.mountpoint}")
        return 0
    return None
