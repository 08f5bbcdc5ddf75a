"""File commands of the CLI (put, get, cat, ls, stat, mkdir, rm, mv,
set-layout) over :class:`tierfs.client.AsyncClient`. Each returns plain data
(dicts and lists that ``--json`` prints as they are) and reports progress
through an optional callback, so the CLI's front end and the tests call the
same functions."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import posixpath
import secrets
import stat as _stat
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import IO, Any

from tierfs.client import AsyncClient, FileStat
from tierfs.client.client import _norm
from tierfs.errors import (
    DirectoryNotEmptyError,
    InvalidArgumentError,
    IsADirectoryError_,
    NotADirectoryError_,
    NotFoundError,
    TierFSError,
)

__all__ = [
    "LocalFileError",
    "Progress",
    "cat",
    "get",
    "ls",
    "mkdir",
    "mv",
    "put",
    "rm",
    "set_layout",
    "stat",
]

#: ``progress(done_bytes, total_bytes_or_None)``, called as bytes move.
Progress = Callable[[int, int | None], None]

#: Bytes moved per step of put/get: several chunks, so the client keeps
#: every placement group busy, small enough to report progress often.
BLOCK = 32 << 20


class LocalFileError(Exception):
    """A local file (the source of ``put``, the target of ``get``) failed;
    the message names the file and the reason."""


def _stat_dict(st: FileStat) -> dict[str, Any]:
    d = dataclasses.asdict(st)
    d["mode"] = oct(st.mode)
    return d


async def _is_dir(client: AsyncClient, path: str) -> bool:
    """Whether ``path`` names a directory, a link to one included (as
    cp(1) and mv(1) judge a destination; until stop 46 a link to a
    directory was replaced by the file put or moved there)."""
    try:
        return (await client.stat(await client.resolve(path))).is_dir
    except NotFoundError:
        return False


async def _through_link(client: AsyncClient, path: str) -> str:
    """``path``, or the file it links to when it is a link to an existing
    file: a put writes through it (as cp(1)), the link stays."""
    try:
        real = await client.resolve(path)
        if real != posixpath.normpath(path) and (await client.stat(real)).is_file:
            return real
    except NotFoundError:
        pass
    return path


def _local_error(what: str, path: str, exc: OSError) -> LocalFileError:
    return LocalFileError(f"{what} {path}: {exc.strerror or exc}")


#: The longest file name, in bytes, of TierFS (meta's MAX_NAME_BYTES) and of
#: the usual local file systems.
NAME_MAX = 255


def _cut_utf8(b: bytes, limit: int) -> bytes:
    """``b``'s first ``limit`` bytes at most, not cutting a UTF-8 character in two."""
    if len(b) <= limit:
        return b
    cut = limit
    while cut > 0 and (b[cut] & 0xC0) == 0x80:  # b[cut] continues a character: cut before it starts
        cut -= 1
    return b[:cut]


def temp_name(name: str, tag: str) -> str:
    """``.NAME.TAG``, with NAME shortened (at a character boundary) so that
    the whole fits in :data:`NAME_MAX` bytes: a file whose name is at the
    limit still gets a temporary name. Local names (``os.fsencode``, so
    undecodable bytes survive) and remote ones (UTF-8) alike."""
    room = NAME_MAX - len(os.fsencode(f"..{tag}"))
    return os.fsdecode(b"." + _cut_utf8(os.fsencode(name), room) + b"." + os.fsencode(tag))


async def put(client: AsyncClient, local: str, remote: str, *, progress: Progress | None = None,
              stdin: IO[bytes] | None = None, into_dir: bool = True, preserve: bool = False) -> dict[str, Any]:
    """Copy local file ``local`` (``-``: standard input) to ``remote`` (a
    directory, or a path ending in ``/``, receives the local file's name;
    ``into_dir=False``: ``remote`` is the file's own path, unchecked).
    The data lands under a temporary name (``.NAME.put-XXXXXXXX``, NAME
    shortened to fit) and is renamed over ``remote`` at the end: readers see
    the old file or the whole new one; a put that fails removes its
    temporary file (one that is killed cannot: the name stays, see
    docs/operations.md). ``preserve``: the copy keeps the local file's
    permission bits and modification time."""
    if into_dir and (remote.endswith("/") or await _is_dir(client, remote)):
        if local == "-":
            raise InvalidArgumentError(f"{remote} is a directory: name the file to write from standard input")
        remote = posixpath.join(remote, os.path.basename(local))
    if into_dir:
        remote = await _through_link(client, remote)
    remote = posixpath.normpath(remote)
    parent, name = posixpath.split(remote)
    tmp = posixpath.join(parent, temp_name(name, f"put-{secrets.token_hex(4)}"))
    try:
        src: IO[bytes] = (stdin or sys.stdin.buffer) if local == "-" else open(local, "rb")  # noqa: SIM115
    except OSError as exc:
        raise _local_error("cannot read local file", local, exc) from None
    lst = None if local == "-" else os.fstat(src.fileno())
    total = None if lst is None else lst.st_size
    # A small file does not need a whole block of buffer (put -r runs several at once).
    buf = bytearray(BLOCK if total is None else min(BLOCK, max(total, 1)))
    view = memoryview(buf)
    done = 0
    t0 = time.perf_counter()
    made = False
    try:
        try:
            f = await client.open(tmp, "xb")
            made = True
        except NotFoundError:
            if parent in ("", "/") or await client.exists(parent):
                raise
            # As cp: no directory is made. Say how to make it.
            raise NotFoundError(f"{parent}: no such directory (make it first: tierfs mkdir -p {parent})") from None
        try:
            if progress:
                progress(0, total)
            while True:
                try:
                    n = src.readinto(view)  # type: ignore[attr-defined]
                except OSError as exc:
                    raise _local_error("cannot read local file", local, exc) from None
                if not n:
                    break
                await f.write(view[:n])  # the encoder copies: ``buf`` is free again on return
                done += n
                if progress:
                    progress(done, total)
            await f.close()
        except BaseException:
            with contextlib.suppress(TierFSError):
                await f.abort()
            raise
        if preserve and lst is not None:
            # After close: the commit stamps the file's mtime.
            await client.meta.setattr(tmp, mode=lst.st_mode & 0o7777, mtime_ns=lst.st_mtime_ns)
        await client.rename(tmp, remote)
    except BaseException as failure:
        try:
            await client.rm(tmp)
        except NotFoundError:
            pass
        except TierFSError as rm_exc:
            # The cleanup failed too (an expired or revoked token fails both):
            # say so, rather than leave a `.NAME.put-...` file unmentioned.
            if made and isinstance(failure, TierFSError):
                failure.message += (f" (its temporary file {tmp} is left behind: {rm_exc}; remove it with "
                                f"`tierfs rm {tmp}`)")
        raise
    finally:
        view.release()
        if src is not (stdin or sys.stdin.buffer):
            src.close()
    dt = time.perf_counter() - t0
    return {"local": local, "remote": remote, "bytes": done, "seconds": dt, "mb_per_s": done / dt / 1e6}


#: Symbolic links followed on the way to a file at most (Linux's MAXSYMLINKS).
MAX_LINK_HOPS = 40


async def _follow(client: AsyncClient, remote: str) -> tuple[str, FileStat]:
    """``remote`` with symbolic links in its last component followed, as
    cat(1) and cp(1) follow them: a relative target is taken from the
    link's directory. Links in the components before it are followed by
    the client's stat and readlink."""
    path = posixpath.normpath(remote)
    for _ in range(MAX_LINK_HOPS):
        st = await client.stat(path)
        if st.type != "symlink":
            return path, st
        target = await client.readlink(path)
        path = posixpath.normpath(target if target.startswith("/") else posixpath.join(posixpath.dirname(path),
                                                                                           target))
    raise InvalidArgumentError(f"{remote}: too many levels of symbolic links (more than {MAX_LINK_HOPS})")


async def _open_remote(client: AsyncClient, remote: str) -> tuple[FileStat, Any]:
    try:
        path, st = await _follow(client, remote)
    except NotFoundError:
        if await _exists(client, remote):
            raise NotFoundError(f"{remote}: a symbolic link to nothing (its target does not exist)") from None
        raise
    if st.is_dir:
        raise IsADirectoryError_(f"{remote}: is a directory")
    return st, await client.open(path, "rb")


async def _exists(client: AsyncClient, path: str) -> bool:
    try:
        await client.stat(posixpath.normpath(path))
        return True
    except NotFoundError:
        return False


async def _stream(f: Any, st: FileStat, sink: Callable[[memoryview], Any], progress: Progress | None) -> int:
    """Read open remote file ``f`` block by block; the next block is
    fetched while the previous one is handed to ``sink`` (in a thread: local
    writes block). Closes ``f``."""
    bufs = [bytearray(min(BLOCK, max(st.size, 1))) for _ in range(2)]
    done = 0
    pending: asyncio.Future[Any] | None = None
    try:
        if progress:
            progress(0, st.size)
        i = 0
        while True:
            view = memoryview(bufs[i % 2])
            n = await f.readinto(view)
            if pending is not None:
                await pending
                pending = None
            if not n:
                break
            pending = asyncio.ensure_future(asyncio.to_thread(sink, view[:n]))
            done += n
            if progress:
                progress(done, st.size)
            i += 1
        if pending is not None:
            await pending
    finally:
        if pending is not None and not pending.done():
            with contextlib.suppress(BaseException):
                await pending
        await f.close()
    return done


def _local_dest(local: str) -> tuple[str, bool]:
    """Where ``get`` writes for ``local``: ``(path, direct)``. A symbolic
    link is followed (its target is written, the link stays). An existing
    file that is not a regular file (a device such as /dev/null, a fifo) is
    written straight into (``direct``): it must not be replaced by a regular
    file. Otherwise the path of a regular file, new or to be replaced. A
    dangling link is refused, as by cp(1)."""
    if os.path.islink(local) and not os.path.exists(local):
        # As cp(1): a dangling link is not written through (that would make
        # a file wherever the link points, outside the destination: a
        # `get -r` whose first run made the link from a remote one).
        raise LocalFileError(f"cannot write local file {local}: not writing through a dangling symbolic link "
                             f"(to {os.readlink(local)}; remove it first)")
    path = os.path.realpath(local) if os.path.islink(local) else local
    try:
        m = os.stat(path).st_mode
    except OSError:
        return path, False  # not there (or unreachable: creating the temporary file says why)
    if _stat.S_ISDIR(m):
        raise LocalFileError(f"cannot write local file {local}: Is a directory")
    return path, not _stat.S_ISREG(m)


def _open_temp(path: str) -> tuple[str, int]:
    """A new file of ours next to ``path`` (``.NAME.XXXXXXXX.tierfs-part``,
    made with O_EXCL: no other file is ever opened or removed)."""
    d, name = os.path.split(path)
    while True:
        tmp = os.path.join(d, temp_name(name, f"{secrets.token_hex(4)}.tierfs-part"))
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue


async def get(client: AsyncClient, remote: str, local: str, *, progress: Progress | None = None,
              into_dir: bool = True, preserve: bool = False) -> dict[str, Any]:
    """Copy ``remote`` to local file ``local`` (a directory receives the
    remote file's name unless ``into_dir=False``). The remote file is opened
    first (a missing one touches nothing local). A regular file (or a new
    one) is written to a temporary file of its own next to it
    (``.NAME.XXXXXXXX.tierfs-part``) and renamed over it at the end, so
    ``local`` is never a torn copy (hard links to the old file keep the old
    contents, as with rsync); a symbolic link's target is replaced, not the
    link. A device or fifo (``/dev/null``) is written straight into, and
    kept. ``preserve``: the copy keeps the remote file's permission bits and
    modification time (not a device's)."""
    if into_dir and os.path.isdir(local):
        local = os.path.join(local, posixpath.basename(remote.rstrip("/")))
    t0 = time.perf_counter()
    st, f = await _open_remote(client, remote)
    tmp: str | None = None
    try:
        path, direct = _local_dest(local)
        try:
            if direct:
                # No O_CREAT, no O_TRUNC: the device stays what it is. A fifo's
                # open waits for a reader: in a thread, not on the event loop.
                fd = await asyncio.to_thread(os.open, path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
            else:
                tmp, fd = _open_temp(path)
        except OSError as exc:
            raise _local_error("cannot write local file", local, exc) from None
        out = open(fd, "wb", closefd=True)  # noqa: SIM115
        try:
            def sink(v: memoryview) -> None:
                try:
                    out.write(v)
                except OSError as exc:
                    raise _local_error("cannot write local file", local, exc) from None

            g, f = f, None  # _stream closes it
            done = await _stream(g, st, sink, progress)
            try:
                out.close()  # the last buffered bytes: /dev/full says ENOSPC here
            except OSError as exc:
                raise _local_error("cannot write local file", local, exc) from None
        finally:
            with contextlib.suppress(OSError):
                out.close()
        if tmp is not None:
            if preserve:
                try:
                    os.chmod(tmp, st.mode & 0o7777)
                    mt = int(st.mtime * 1e9)
                    os.utime(tmp, ns=(mt, mt))
                except OSError as exc:
                    raise _local_error("cannot set attributes of local file", local, exc) from None
            try:
                os.replace(tmp, path)
            except OSError as exc:  # e.g. a directory is in the way
                raise _local_error("cannot write local file", local, exc) from None
            tmp = None
    except BaseException:
        if f is not None:
            with contextlib.suppress(TierFSError):
                await f.close()
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    dt = time.perf_counter() - t0
    return {"remote": remote, "local": local, "bytes": done, "seconds": dt, "mb_per_s": done / dt / 1e6}


async def cat(client: AsyncClient, remote: str, out: IO[bytes]) -> dict[str, Any]:
    """Write ``remote``'s bytes to ``out`` (standard output in the CLI)."""
    t0 = time.perf_counter()

    def sink(v: memoryview) -> None:
        out.write(v)
        out.flush()

    st, f = await _open_remote(client, remote)
    done = await _stream(f, st, sink, None)
    return {"remote": remote, "bytes": done, "seconds": time.perf_counter() - t0}


async def ls(client: AsyncClient, path: str = "/") -> list[dict[str, Any]]:
    """A directory's entries (sorted by name), or the one entry of a file."""
    st = await client.stat(path)
    if st.type == "symlink":
        # a link to a directory lists the directory, as ls(1) does with a
        # link named on its command line
        try:
            target_is_dir = (await client.stat(await client.resolve(path))).is_dir
        except (NotFoundError, InvalidArgumentError):
            target_is_dir = False  # dangling, or a loop: the link itself
        if target_is_dir:
            return [await _with_target(client, _stat_dict(e)) for e in await client.ls(path, detail=True)]
    if not st.is_dir:
        return [await _with_target(client, _stat_dict(st))]
    return [await _with_target(client, _stat_dict(e)) for e in await client.ls(path, detail=True)]


async def ls_one(client: AsyncClient, path: str) -> dict[str, Any]:
    """:func:`ls` of one of several paths (``tierfs ls A B``)."""
    return {"path": path, "entries": await ls(client, path)}


async def _with_target(client: AsyncClient, d: dict[str, Any]) -> dict[str, Any]:
    """A symbolic link's entry gets its ``target`` (ls -l shows it)."""
    if d["type"] == "symlink":
        d["target"] = await client.readlink(d["path"])
    return d


async def stat(client: AsyncClient, path: str) -> dict[str, Any]:
    """Attributes and layout of one file or directory."""
    st = await client.stat(path)
    # As the client reads the path: repeated slashes, leading ones too, are
    # one (until stop 49 "tierfs stat //a" failed 'empty name': normpath
    # keeps two leading slashes, and this call goes to meta directly).
    norm = posixpath.normpath(_norm(path))
    try:
        info = await client.meta.stat(norm)
    except NotADirectoryError_:  # a link in the middle of the path
        info = await client.meta.stat(await client.resolve(norm, last=False))
    lay = info.layout
    out = await _with_target(client, _stat_dict(st))
    out["layout"] = {
        "chunk_size": lay.chunk_size, "redundancy": lay.redundancy, "stripe_width": lay.stripe_width,
        "data_shards": lay.data_shards, "parity_shards": lay.parity_shards, "groups": list(lay.groups),
    }
    out["chunks"] = len(info.chunks)
    out["chunks_degraded"] = sum(1 for r in info.chunks if r.missing)
    out["data_version"] = info.attr.data_version
    return out


def _checked_dir_path(path: str) -> str:
    """``path`` with repeated slashes made one (as POSIX reads them) and a
    trailing one dropped, every component checked as meta checks names
    (``.``, ``..``, a name over 255 bytes, a NUL byte are refused, the
    message naming ``path``), before anything is made: ``mkdir -p`` of a
    bad path makes no directory."""
    from tierfs.meta.ops import split_path

    if not path.startswith("/"):
        raise InvalidArgumentError(f"paths are absolute (start with '/'), got {path!r}")
    norm = "/" + "/".join(p for p in path.split("/") if p)
    try:
        split_path(norm)
    except TierFSError as exc:
        raise type(exc)(f"{path}: {exc}") from None
    return norm


async def mkdir(client: AsyncClient, path: str, *, parents: bool = False) -> dict[str, Any]:
    norm = _checked_dir_path(path)
    try:
        await client.mkdir(norm, parents=parents, exist_ok=parents)
    except NotFoundError as exc:
        if parents:
            raise
        raise NotFoundError(f"{exc} (mkdir -p makes the missing parents too)") from None
    return {"path": path, "created": True}


async def each(client: AsyncClient, fn: Callable[..., Awaitable[dict[str, Any]]], paths: Sequence[str],
               **kw: Any) -> dict[str, Any]:
    """``fn(client, path, **kw)`` for each path in order (``mkdir`` and
    ``rm`` of several paths): every path is tried; the results, and the
    failures as ``{"path", "code", "message"}``."""
    results: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for path in paths:
        try:
            results.append(await fn(client, path, **kw))
        except TierFSError as exc:
            errors.append({"path": path, "code": exc.code_name, "message": str(exc)})
    return {"results": results, "errors": errors}


async def rm(client: AsyncClient, path: str, *, recursive: bool = False,
             progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Remove a file or an empty directory (a whole tree with ``recursive``).
    Fragments are freed in the background by garbage collection.
    ``progress``: as for ``AsyncClient.rm``."""
    if posixpath.normpath("/" + path.lstrip("/")) == "/":
        raise InvalidArgumentError("refusing to remove the root directory")
    try:
        await client.rm(path, recursive=recursive, progress=progress)
    except DirectoryNotEmptyError as exc:
        raise DirectoryNotEmptyError(f"{exc} (rm -r removes it with its contents)") from None
    return {"path": path, "removed": True}


async def chattr(client: AsyncClient, path: str, *, mode: int | None = None, uid: int | None = None,
                 gid: int | None = None) -> dict[str, Any]:
    """chmod (``mode``) or chown (``uid``/``gid``) of one path."""
    if mode is not None:
        await client.chmod(path, mode)
    else:
        await client.chown(path, uid, gid)
    return {"path": path}


async def mv(client: AsyncClient, src: str, dst: str) -> dict[str, Any]:
    """Rename ``src`` to ``dst`` (into ``dst`` if it is a directory, as mv(1))."""
    if dst.endswith("/") or (await _is_dir(client, dst) and not await _same(client, src, dst)):
        dst = posixpath.join(dst, posixpath.basename(src.rstrip("/")))
    await client.rename(src, dst)
    return {"src": src, "dst": dst}


async def _same(client: AsyncClient, a: str, b: str) -> bool:
    try:
        return (await client.stat(a)).inode == (await client.stat(b)).inode
    except NotFoundError:
        return False


async def set_layout(client: AsyncClient, path: str, *, redundancy: str = "", chunk_size: int = 0,
                     stripe: int = 0) -> dict[str, Any]:
    """Layout for files created under directory ``path`` from now on
    (existing files keep theirs). Zero/empty fields are inherited."""
    if not (await client.stat(path)).is_dir:
        raise InvalidArgumentError(f"{path} is not a directory: set-layout applies to directories "
                                   "(files take their directory's layout when created)")
    lay = await client.set_layout(path, chunk_size=chunk_size, redundancy=redundancy, stripe_width=stripe)
    out: dict[str, Any] = {"path": path, "chunk_size": lay.chunk_size, "redundancy": lay.redundancy,
                           "stripe_width": lay.stripe_width}
    # A layout wider than the cluster is legal (nodes may join), but every
    # write under it fails until they do: say so now, not at the first put.
    kind, _, spec = lay.redundancy.partition(":")
    try:
        width = sum(int(x) for x in spec.split("+")) if kind == "ec" else int(spec)
    except ValueError:
        width = 0
    if width:
        from tierfs.proto.v1 import meta_pb2 as pb

        cmap = await client.meta.get_cluster_map()
        online = {n.node_id for n in cmap.nodes if n.state == pb.NODE_STATE_ONLINE}
        nodes = len({t.node_id for t in cmap.targets if t.node_id in online and t.state == pb.TARGET_STATE_ONLINE})
        if nodes < width:
            out["warning"] = (f"{lay.redundancy} places {width} fragments on distinct storage nodes, and {nodes} "
                              f"node(s) have an online target now: writes under {path} fail until {width} do")
    return out
