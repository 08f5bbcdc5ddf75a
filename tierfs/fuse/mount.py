"""Mounting and unmounting: checks that fail early with a clear message, the
pyfuse3 session on an asyncio loop (the loop the ``AsyncClient`` runs on),
SIGTERM/SIGINT handling, and the daemon (``fork``) mode.

The daemon forks before anything opens a gRPC channel (gRPC does not
survive ``fork``); the parent waits on a pipe until the child has mounted
(or failed) and exits with the child's verdict, so ``tierfs mount`` returns
only once the mount is usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierfs.errors import InvalidArgumentError, TierFSError, UnavailableError

__all__ = ["FUSE_TYPE", "MountConfig", "MountError", "find_mount", "mount", "unmount"]

log = logging.getLogger("tierfs.fuse")

#: The file-system type of a TierFS mount in /proc/self/mountinfo.
FUSE_TYPE = "fuse.tierfs"


class MountError(InvalidArgumentError):
    """A mount or unmount that cannot go ahead (bad mountpoint, already
    mounted, not mounted, fusermount3 failed)."""


@dataclass(frozen=True, slots=True)
class MountConfig:
    mountpoint: str
    meta: Sequence[str]
    allow_other: bool = False
    attr_timeout: float = 1.0
    entry_timeout: float = 1.0
    read_ahead_kib: int = 4096
    #: Seconds to wait for the cluster before giving up.
    timeout: float = 20.0
    max_tasks: int = 64
    log_file: str | None = None
    debug: bool = False


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1: i + 4].isdigit() and len(field[i + 1: i + 4]) == 3:
            out.append(chr(int(field[i + 1: i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _resolve(path: str) -> str:
    """The absolute path, its parent's symlinks resolved, without touching
    ``path`` itself (a stat of a mount point is served by its daemon, which
    may be this process, or hung)."""
    p = os.path.abspath(path)
    head, tail = os.path.split(p)
    return os.path.join(os.path.realpath(head), tail) if tail else p


def find_mount(path: str) -> tuple[str, str, str] | None:
    """(file-system type, source, "major:minor") of the mount at exactly
    ``path``, or None. Read from /proc/self/mountinfo: a ``stat`` of a FUSE
    mount point would wait on the file system itself."""
    target = _resolve(path)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found: tuple[str, str, str] | None = None
    for line in lines:
        left, sep, right = line.partition(" - ")
        parts = left.split()
        if not sep or len(parts) < 5:
            continue
        if _unescape(parts[4]) == target:
            fstype, *rest = right.split()
            found = (fstype, _unescape(rest[0]) if rest else "", parts[2])  # the last one listed is on top
    return found


def _check_mountpoint(path: str) -> str:
    p = _resolve(path)
    try:
        os.stat(p)
    except FileNotFoundError:
        raise MountError(f"mountpoint {p} does not exist (create it first: mkdir -p {p})") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN and find_mount(p) is not None:
            # os.path.exists said False for this too, and the hint was mkdir
            raise MountError(f"{p} is a dead mount (the process that served it is gone): "
                             f"unmount it first (tierfs umount {p})") from None
        raise MountError(f"mountpoint {p}: {exc.strerror}") from None
    if not os.path.isdir(p):
        raise MountError(f"mountpoint {p} is not a directory")
    got = find_mount(p)
    if got is not None:
        raise MountError(f"{p} is already a mount point ({got[0]} {got[1]}); "
                         f"unmount it first (tierfs umount {p})")
    if shutil.which("fusermount3") is None:
        raise MountError("fusermount3 not found (install fuse3)")
    if not os.path.exists("/dev/fuse"):
        raise MountError("/dev/fuse does not exist (load the fuse module, or give the container the device)")
    try:
        hidden = next(os.scandir(p), None)
    except OSError:
        hidden = None
    if hidden is not None:
        # As mount(8): allowed, but said (a mount over files hid them without a word until stop 47).
        print(f"tierfs mount: warning: {p} is not empty ({hidden.name}, ...): its contents are hidden while "
              f"TierFS is mounted there", file=sys.stderr)
    return p


def _set_read_ahead(mountpoint: str, kib: int) -> None:
    """The kernel's read-ahead for this mount (its backing-device info): the
    default 128 KiB makes every sequential read a string of small FUSE
    requests. Best effort (needs root)."""
    got = find_mount(mountpoint)
    if got is None:
        return
    path = Path(f"/sys/class/bdi/{got[2]}/read_ahead_kb")
    try:
        path.write_text(str(kib))
    except OSError as exc:
        log.info("could not set %s to %d: %s", path, kib, exc)


async def _first_request(mountpoint: str, serving: asyncio.Future[Any], timeout: float) -> bool:
    """Wait until the kernel has had a request answered on the new mount
    (so FUSE_INIT's reply is applied). False if that did not happen within
    ``timeout``; if serving stopped first, its error is raised."""
    probe: asyncio.Future[Any] = asyncio.ensure_future(asyncio.to_thread(os.stat, mountpoint))
    done, _ = await asyncio.wait({probe, serving}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if serving in done and probe not in done:
        probe.cancel()  # the thread ends when the kernel fails its stat
        serving.result()
        raise MountError(f"the FUSE session for {mountpoint} ended before it served a request")
    if probe not in done:
        log.warning("%s: no FUSE request answered within %.0f s; read-ahead left as the kernel set it",
                    mountpoint, timeout)
        probe.add_done_callback(lambda f: f.cancelled() or f.exception())
        return False
    if probe.exception() is not None:
        log.warning("%s: stat of the new mount failed (%s); read-ahead left as the kernel set it", mountpoint,
                    probe.exception())
        return False
    return True


async def _serve(cfg: MountConfig, ready: int | None) -> None:
    import pyfuse3
    import pyfuse3.asyncio as fuse_asyncio

    from tierfs.client import AsyncClient
    from tierfs.fuse.ops import MountOptions, TierFSOperations

    fuse_asyncio.enable()
    client = AsyncClient(list(cfg.meta), meta_deadline=cfg.timeout, meta_attempt_timeout=min(3.0, cfg.timeout))
    try:
        try:
            await client.meta.stat(1)  # reachable, before the kernel sees anything
        except UnavailableError as exc:
            raise UnavailableError(f"cannot mount: {exc}") from None
        ops = TierFSOperations(client, MountOptions(cfg.attr_timeout, cfg.entry_timeout, cfg.read_ahead_kib))
        opts = {"fsname=tierfs", "subtype=tierfs", "default_permissions"}
        if cfg.allow_other:
            opts.add("allow_other")
        if cfg.debug:
            opts.add("debug")
        pyfuse3.init(ops, cfg.mountpoint, opts)
        loop = asyncio.get_running_loop()
        stopping: list[int] = []

        def stop(sig: int) -> None:
            if not stopping:
                log.info("signal %d: unmounting %s", sig, cfg.mountpoint)
                stopping.append(sig)
                pyfuse3.terminate()

        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(s, stop, s)
        try:
            serving = asyncio.ensure_future(pyfuse3.main(max_tasks=cfg.max_tasks))
            # The kernel applies the reply to FUSE_INIT, which caps the mount's
            # read-ahead at what it offered (128 KiB), when the first request
            # is served, not at mount(2): the read-ahead is set only after a
            # stat of the mount point (from a thread; this loop answers it)
            # has come back, or it would be undone.
            if await _first_request(cfg.mountpoint, serving, cfg.timeout):
                _set_read_ahead(cfg.mountpoint, cfg.read_ahead_kib)
            if ready is not None:
                os.write(ready, b"ok\n")
                os.close(ready)
                ready = None
            log.info("mounted %s (meta %s) pid %d", cfg.mountpoint, ",".join(cfg.meta), os.getpid())
            await serving
        finally:
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(s)
            await ops.commit_all()
            # After `fusermount3 -u` the kernel side is gone already;
            # after a signal this is what unmounts.
            pyfuse3.close(unmount=True)
            log.info("unmounted %s", cfg.mountpoint)
    finally:
        await client.close()


def _run(cfg: MountConfig, ready: int | None) -> None:
    import uvloop

    uvloop.run(_serve(cfg, ready))


def _setup_logging(cfg: MountConfig, *, foreground: bool) -> None:
    handler: logging.Handler
    if cfg.log_file:
        handler = logging.FileHandler(cfg.log_file)
    elif foreground:
        handler = logging.StreamHandler(sys.stderr)
    else:
        return
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in ("tierfs", "pyfuse3"):
        lg = logging.getLogger(name)
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG if cfg.debug else logging.INFO)


def mount(cfg: MountConfig, *, foreground: bool) -> None:
    """Mount TierFS at ``cfg.mountpoint``. Foreground: serve until unmounted
    or signalled. Otherwise: return once a daemon has mounted it (raises with
    the daemon's message if it could not)."""
    # The log file's path is made absolute before the daemon's chdir("/")
    # (a relative --log went to /NAME, or failed where / is not writable).
    cfg = MountConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__},
                         "mountpoint": _check_mountpoint(cfg.mountpoint),
                         "log_file": os.path.abspath(cfg.log_file) if cfg.log_file else cfg.log_file})
    if foreground:
        _setup_logging(cfg, foreground=True)
        _run(cfg, None)
        return
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon
        os.close(r)
        code = 0
        try:
            os.setsid()
            _detach()
            _setup_logging(cfg, foreground=False)
            _run(cfg, w)
        except BaseException as exc:
            code = 1
            msg = str(exc) if isinstance(exc, TierFSError | OSError | RuntimeError) else repr(exc)
            log.exception("mount failed")
            with contextlib.suppress(OSError):
                os.write(w, f"error {type(exc).__name__}: {msg}\n".encode())
        finally:
            os._exit(code)
    os.close(w)
    # The daemon answers once mounted, or when it gives up on the cluster
    # (cfg.timeout); a daemon stuck past that is killed, not waited on.
    ok, _, _ = select.select([r], [], [], cfg.timeout + 30.0)
    if not ok:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        raise MountError(f"the mount daemon did not answer in {cfg.timeout + 30.0:.0f} s (killed; see --log)")
    with os.fdopen(r, "rb") as f:
        reply = f.readline().decode(errors="replace").strip()
    if reply == "ok":
        return
    if not reply:
        os.waitpid(pid, 0)
        raise MountError("the mount daemon exited without mounting (see --log)")
    kind, _, msg = reply.removeprefix("error ").partition(": ")
    os.waitpid(pid, 0)
    if kind == "UnavailableError":
        raise UnavailableError(msg)
    raise MountError(msg)


def _detach() -> None:
    fd = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(fd, std)
    if fd > 2:
        os.close(fd)
    os.chdir("/")


def unmount(mountpoint: str, *, lazy: bool = False, timeout: float = 20.0) -> None:
    """``fusermount3 -u`` a TierFS mount; the daemon then publishes what is
    open for writing and exits."""
    p = _resolve(mountpoint)
    got = find_mount(p)
    if got is None:
        raise MountError(f"{p} is not mounted")
    if got[0] != FUSE_TYPE:
        raise MountError(f"{p} is not a TierFS mount (it is {got[0]} {got[1]})")
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [p]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise MountError(f"{' '.join(cmd)} did not finish in {timeout:.0f} s") from None
    if res.returncode != 0:
        why = res.stderr.strip() or f"exit status {res.returncode}"
        hint = " (files are open there; close them, or use --lazy)" if "busy" in why.lower() else ""
        raise MountError(f"unmounting {p} failed: {why}{hint}")
