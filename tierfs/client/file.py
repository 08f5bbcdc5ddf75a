"""``AsyncFile``: an open TierFS file (reader, writer, or both).

A writer holds a write session (``open_write``) whose lease a background
task renews, telling meta which chunk uploads it has begun (so they are
garbage-collected if the writer dies). Every upload of a chunk gets its own
generation (``tierfs.chunk.generation``): a chunk sent twice in one session
(after a ``flush``, or a seek back) never reuses the keys of the first
upload, so a fragment of the first that a returning node still holds cannot
pass for the second. Writes land in one staging chunk (a
pool buffer); a full chunk, or a chunk left behind by a seek, is encoded and
sent while the caller goes on writing, at most ``write_concurrency`` chunks
at once. A write that covers a whole chunk is encoded straight from the
caller's memory. A partial write over existing data reads the chunk first
(read-modify-write). ``close`` waits until every fragment is durable and
then commits the size and one record per chunk written (generation, length,
CRC32C of its bytes, fragments not stored: ``commit_write``): only then do
readers see the new contents. Before it commits, a writer whose groups
moved during the session (rebalance moves, drains) sends the moved
fragments to the current members (``_settle_moves``), and it commits again
if meta still finds it stale. Any failure aborts the session (nothing of
it becomes visible) and the error surfaces at the next call or at close.

``flush`` makes the data written so far durable on the storage targets but
does not publish it (the session stays open); a file is published at close.
Readers of a file opened read-only serve small reads from a one-chunk
cache and read the next chunk ahead meanwhile (sequential readers of small
records would otherwise pay a round trip per call).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from types import TracebackType
from typing import TYPE_CHECKING, Any

from tierfs.chunk import (
    MAX_UPLOAD_SEQ,
    ChunkRecord,
    chunk_records,
    crc32c,
    generation,
    moved_positions,
    valid_bytes,
)
from tierfs.client.client import FileView, _as_bytes_view, _zero
from tierfs.client.fanout import first_error, ordered
from tierfs.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    SessionExpiredError,
    StaleVersionError,
    TierFSError,
    TimeoutError_,
    UnavailableError,
)
from tierfs.meta.ops import MAX_CHUNKS_PER_REQUEST
from tierfs.proto.v1 import meta_pb2 as pb

if TYPE_CHECKING:
    from tierfs.client.client import AsyncClient

__all__ = ["AsyncFile"]

log = logging.getLogger(__name__)

#: Commits a writer tries when meta refuses one as stale (the group moved
#: again between its look at the map and the commit).
_COMMIT_TRIES = 3


def _left(until: float | None) -> float | None:
    """The seconds left until loop time ``until`` (None: no bound)."""
    return None if until is None else max(0.0, until - asyncio.get_running_loop().time())


def _parse_mode(mode: str) -> tuple[str, bool]:
    """``"r+b"`` -> ("r", True). Text mode is refused."""
    if "t" in mode:
        raise InvalidArgumentError(f"text mode {mode!r} is not supported: TierFS files are binary")
    base = mode.replace("b", "")
    plus = "+" in base
    base = base.replace("+", "")
    if base not in ("r", "w", "a", "x") or len(mode) != len(set(mode)):
        raise InvalidArgumentError(f"invalid mode {mode!r} (r, w, a, x, with optional + and b)")
    return base, plus


#: Chunks a file's read cache holds (the read-ahead one included).
_CACHED_CHUNKS = 4


class _Staging:
    """The chunk being written: ``buf[:fill]`` is its content."""

    __slots__ = ("buf", "fill", "idx")

    def __init__(self, idx: int, buf: memoryview, fill: int) -> None:
        self.idx, self.buf, self.fill = idx, buf, fill


async def _remove_created(client: AsyncClient, path: str, inode: int) -> None:
    """A write that created ``path`` failed or was aborted: remove the file
    again, as if it had never been made, but only while the name still
    refers to that inode and the file is empty with no writer (meta checks
    both in the one op; BusyError leaves it). Best effort: a writer that
    dies, or a meta it cannot reach, leaves the empty file (docs/client.md)."""
    try:
        await client.meta.unlink(path, expect_inode=inode, only_if_empty=True)
    except TierFSError as exc:
        log.debug("%s: the file this failed write created was left (%s)", path, exc)


class AsyncFile:
    """Use :meth:`AsyncClient.open` to get one."""

    def __init__(self, client: AsyncClient, path: str, mode: str, info: pb.FileInfo, *,
                 readable: bool, writable: bool, append: bool, session: pb.OpenWriteReply | None,
                 replace: bool = False, created: int = 0) -> None:
        self._client = client
        #: The inode this open created (0: the file was there): an abort
        #: removes it again, if it is still that inode and still empty.
        self._created = created
        self.path = path
        self.mode = mode
        self._readable = readable
        self._writable = writable
        self._append = append
        self._info = info
        self._view = FileView.of(path, info)
        self.size = info.attr.size
        self.pos = self.size if append else 0
        self.closed = False
        self._session = session
        #: The cluster map version whose group members hold every fragment
        #: this writer stored (sent at commit; 0: unknown): the version it
        #: opened with, then the one ``_settle_moves`` brought them to.
        self.map_version = 0
        self._committed = chunk_records(info)
        #: A ``w`` open of a file with contents: the session writes the
        #: file anew, as if truncated, but the old contents stay what every
        #: reader sees until the commit replaces them (an abort keeps them;
        #: the truncate at open lost them to a writer that failed). The old
        #: chunk indices: those under the new size that this session does
        #: not write are written as zeros before the commit.
        self._replaced: set[int] = set()
        if replace:
            self._replaced = set(self._committed)
            self._committed = {}
            self.size = 0
        self._written: dict[int, ChunkRecord] = {}  # chunks stored in this session
        self._placed: dict[int, tuple[int, ...]] = {}  # chunk -> the targets its fragments in _written are on
        self._uploads: dict[int, int] = {}  # chunk -> uploads begun in this session
        self._unreported: list[tuple[int, int]] = []  # uploads (chunk, generation) meta was not told of
        self._unstaged: set[int] = set()  # chunks whose record in _written meta has not staged
        self._renew_lock = asyncio.Lock()
        self._staging: _Staging | None = None
        self._inflight: dict[int, asyncio.Task[None]] = {}
        self._error: TierFSError | None = None
        self._slots = asyncio.Semaphore(client.config.write_concurrency)
        self._renewer: asyncio.Task[None] | None = None
        # The read cache of small reads: chunk -> (its load, valid bytes when
        # done; the pooled buffer it fills), for the chunk read last, the one
        # before it and the next one (read ahead).
        self._chunks: dict[int, tuple[asyncio.Task[int], memoryview]] = {}
        #: the view (generation) each cached chunk's load was served from
        self._served: dict[asyncio.Task[int], FileView] = {}
        if session is not None:
            self._start_renewer()
            # A write capability that expires is renewed with the lease.
            client._cap_renewers[info.attr.inode] = self._renew

    @classmethod
    async def open(cls, client: AsyncClient, path: str, mode: str, *, links_refused: bool = False) -> AsyncFile:
        """``links_refused``: a symbolic link at ``path`` raises the client's
        ``_IsLink`` (which ``AsyncClient.open`` follows) instead of "not a
        regular file"."""
        if not links_refused:
            return await cls._open(client, path, mode)
        try:
            return await cls._open(client, path, mode)
        except InvalidArgumentError:
            from tierfs.client.client import _IsLink

            try:
                info = await client.meta.stat(path)
            except TierFSError:
                info = None
            if info is not None and info.attr.type == pb.INODE_TYPE_SYMLINK:
                raise _IsLink(path) from None
            raise

    @classmethod
    async def _open(cls, client: AsyncClient, path: str, mode: str) -> AsyncFile:
        base, plus = _parse_mode(mode)
        meta = client.meta
        if base == "r" and not plus:
            info = await meta.stat(path)
            FileView.of(path, info)  # a directory or symlink is refused here
            return cls(client, path, mode, info, readable=True, writable=False, append=False, session=None)
        created = 0
        if base == "x":
            created = (await meta.create(path)).attr.inode
        elif base in ("w", "a"):
            try:
                created = (await meta.create(path)).attr.inode
            except AlreadyExistsError:
                if base == "w":
                    FileView.of(path, await meta.stat(path))  # a directory or symlink is refused here
        cfg = client.config
        try:
            reply = await meta.open_write(path, owner=f"tierfs-client pid {os.getpid()}", lease_ms=cfg.lease_ms)
        except BaseException:
            if created:
                await _remove_created(client, path, created)
            raise
        try:
            placed = await client.placement_version()
            # "w": the old contents, if any, are replaced at close, not
            # truncated at open (see AsyncFile._replaced).
            f = cls(client, path, mode, reply.file, readable=plus, writable=True, append=base == "a",
                    session=reply, replace=base == "w" and bool(reply.file.attr.size or len(reply.file.chunks)),
                    created=created)
            f.map_version = placed
            return f
        except BaseException:
            with contextlib.suppress(TierFSError):
                await meta.abort_write(reply.session_id)
                if created:
                    await _remove_created(client, path, created)
            raise

    # ---- properties -----------------------------------------------------------

    def readable(self) -> bool:
        return self._readable

    def writable(self) -> bool:
        return self._writable

    def seekable(self) -> bool:
        return True

    @property
    def inode(self) -> int:
        return self._view.inode

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._check_open()
        if whence == os.SEEK_SET:
            pos = offset
        elif whence == os.SEEK_CUR:
            pos = self.pos + offset
        elif whence == os.SEEK_END:
            pos = self.size + offset
        else:
            raise InvalidArgumentError(f"bad whence {whence}")
        if pos < 0:
            raise InvalidArgumentError(f"negative seek position {pos}")
        self.pos = pos
        return pos

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file")

    # ---- reading ----------------------------------------------------------------

    def _current_view(self) -> FileView:
        v = self._view
        if not self._writable:
            return v
        written, committed = self._written, self._committed

        def record(idx: int) -> ChunkRecord | None:
            got = written.get(idx)
            return got if got is not None else committed.get(idx)

        return FileView(v.path, v.inode, self.size, v.chunk_size, v.codec, v.groups, record)

    async def readinto(self, buffer: Any) -> int:
        self._check_open()
        if not self._readable:
            raise InvalidArgumentError(f"{self.path} is not open for reading (mode {self.mode!r})")
        dest = _as_bytes_view(buffer)
        if self._writable:
            await self.flush()
        n = await self._read_at(self.pos, dest)
        self.pos += n
        return n

    async def read(self, size: int = -1) -> bytes:
        self._check_open()
        if size is None or size < 0:
            size = max(0, self.size - self.pos)
        size = max(0, min(size, self.size - self.pos))
        buf = bytearray(size)
        n = await self.readinto(buf)
        return bytes(buf) if n == size else bytes(buf[:n])

    async def _read_at(self, offset: int, dest: memoryview) -> int:
        view = self._current_view()
        cs = view.chunk_size
        if self._writable:
            return await self._client._read_range(view, offset, dest)
        if len(dest) >= cs // 2:
            n, self._view = await self._client._read_fresh(view, offset, dest)
            return n
        # Small reads go through the read cache (sequential readers of
        # small records would otherwise pay a round trip each).
        end = min(offset + len(dest), view.size)
        done = 0
        while offset + done < end:
            idx, off = divmod(offset + done, cs)
            got = await self._cached(view, idx)
            if got is None:
                # No room in the client's read cache: the rest is read directly.
                n, self._view = await self._client._read_fresh(view, offset + done, dest[done: end - offset])
                return done + n
            buf, valid, served = got
            if served is not view:
                # The file was rewritten and this chunk came from the new
                # generation (a load found the old one collected), the bytes
                # before it from the old one: never a mix. The cached chunks
                # of other generations go, and the whole read is done again
                # directly, from one generation.
                for k, (task, _) in list(self._chunks.items()):
                    if not task.done() or self._served.get(task) is not self._view:
                        self._drop_chunk(k)
                n, self._view = await self._client._read_fresh(self._view, offset, dest)
                return n
            n = min(end - offset - done, valid - off)
            if n <= 0:
                break
            dest[done: done + n] = buf[off: off + n]
            done += n
        return done

    async def _cached(self, view: FileView, idx: int) -> tuple[memoryview, int, FileView] | None:
        """Chunk ``idx`` from the read cache; a miss loads it, and the next
        chunk is read ahead. Up to ``_CACHED_CHUNKS`` chunks stay cached, so
        that readers whose requests arrive out of order (the kernel's
        read-ahead through a FUSE mount: several requests in flight, up to
        a few chunks ahead) do not load a chunk twice. None: the client's
        read cache has no room for it (``ReadCacheBudget``)."""
        chunks = self._chunks
        ahead = idx in chunks  # loaded (or being loaded) before this call asked for it
        if ahead:
            self._client.read_cache.touch(chunks[idx][0])
        else:
            load = self._start_load(view, idx, (idx,))
            if load is None:
                return None
            chunks[idx] = load
        if idx + 1 not in chunks and (idx + 1) * view.chunk_size < view.size:
            load = self._start_load(view, idx + 1, (idx, idx + 1))
            if load is not None:
                chunks[idx + 1] = load
        # Over capacity, the chunks farthest from this one go first.
        while len(chunks) > _CACHED_CHUNKS:
            self._drop_chunk(max((k for k in chunks if k not in (idx, idx + 1)), key=lambda k: abs(k - idx)))
        task, buf = chunks[idx]
        try:
            # Shielded: a caller that gives up leaves the load to the next one.
            n = await asyncio.shield(task)
            return buf, n, self._served.get(task, view)
        except TierFSError:
            if chunks.get(idx, (None,))[0] is task:
                self._drop_chunk(idx)
            if not ahead:
                raise
        # A read-ahead that failed is read again: the error surfaces if it persists.
        load = self._start_load(view, idx, (idx,))
        if load is None:
            return None
        chunks[idx] = load
        task, buf = load
        n = await asyncio.shield(task)
        return buf, n, self._served.get(task, view)

    def _start_load(self, view: FileView, idx: int,
                    keep: tuple[int, ...]) -> tuple[asyncio.Task[int], memoryview] | None:
        """Chunk ``idx``'s load into a pooled buffer of its size, the
        buffer's bytes reserved in the client's read cache; None when they
        do not fit."""
        nbytes = min(view.chunk_size, view.size - idx * view.chunk_size)
        budget, pool = self._client.read_cache, self._client.pool
        cost = pool.region_size(nbytes)  # what the buffer takes in memory (a 100-byte file: a page)
        if not budget.reserve(cost, self, keep):
            return None
        try:
            buf = pool.get(nbytes)
        except BaseException:
            budget.used -= cost
            raise
        task = asyncio.get_running_loop().create_task(self._load_chunk(view, idx, buf))
        budget.register(task, self, idx, cost)
        return task, buf

    def _drop_chunk(self, idx: int) -> None:
        """Forget cached chunk ``idx``; its buffer goes back to the pool (and
        its bytes to the read cache) once its load has ended (a cancelled
        read never writes it again)."""
        got = self._chunks.pop(idx, None)
        if got is None:
            return
        task, buf = got
        pool = self._client.pool
        budget = self._client.read_cache

        def release(t: asyncio.Task[int]) -> None:
            self._served.pop(t, None)
            if not t.cancelled():
                t.exception()  # retrieved: a failed read-ahead nobody waited for is not an error
            pool.put(buf)
            budget.release(t)

        if task.done():
            release(task)
        else:
            task.cancel()
            task.add_done_callback(release)

    async def _load_chunk(self, view: FileView, idx: int, buf: memoryview) -> int:
        cs = view.chunk_size
        n, fresh = await self._client._read_fresh(view, idx * cs, buf)
        if fresh is not view and not self._writable:
            self._view = fresh  # rewritten meanwhile: later reads start from the new generation
        task = asyncio.current_task()
        if task is not None:
            self._served[task] = fresh
        return n

    # ---- writing ----------------------------------------------------------------

    async def write(self, data: Any) -> int:
        self._check_open()
        if not self._writable:
            raise InvalidArgumentError(f"{self.path} is not open for writing (mode {self.mode!r})")
        if self._error is not None:
            raise self._error
        view = _as_bytes_view(data)
        if self._append:
            self.pos = self.size
        cs = self._view.chunk_size
        codec = self._view.codec
        total, done = len(view), 0
        while done < total:
            idx, off = divmod(self.pos, cs)
            n = min(cs - off, total - done)
            piece = view[done: done + n]
            if self._staging is not None and self._staging.idx != idx:
                await self._stage_out()
            if (self._staging is None and n == cs and not codec.replicated
                    and codec.encode_size(cs) == cs):
                # A whole chunk: encode from the caller's memory (the encoder
                # copies it), no staging copy.
                await self._wait_chunk(idx)
                await self._submit(idx, codec.encode(piece, cs, cs), None, crc32c(piece))
            else:
                if self._staging is None:
                    try:
                        self._staging = await self._load(idx)
                    except TierFSError as exc:
                        # The chunk's old bytes could not be read: this call
                        # stops part-way (earlier chunks of it are staged),
                        # so the session aborts like after any failure.
                        if self._error is None:
                            self._error = exc
                        raise
                st = self._staging
                if off > st.fill:
                    st.buf[st.fill: off] = bytes(off - st.fill)
                st.buf[off: off + n] = piece
                st.fill = max(st.fill, off + n)
                if st.fill == cs and off + n == cs:
                    # Written up to the chunk's end (a sequential writer is
                    # done with it): upload it now. A write inside a chunk
                    # that was loaded whole leaves it staged, until a write
                    # to another chunk, a flush or the commit (it was
                    # uploaded again at every such write before: a
                    # read and a rewrite of the whole chunk per 4 KiB page).
                    await self._stage_out()
            done += n
            self.pos += n
            if self.pos > self.size:
                self.size = self.pos
        return total

    async def _wait_chunk(self, idx: int) -> None:
        t = self._inflight.get(idx)
        if t is not None:
            await asyncio.wait([t])

    async def _load(self, idx: int) -> _Staging:
        """A staging buffer for chunk ``idx`` holding its current contents."""
        cs = self._view.chunk_size
        pool = self._client.pool
        buf = pool.get(self._view.codec.encode_size(cs))
        fill = 0
        start = idx * cs
        try:
            await self._wait_chunk(idx)  # an upload in flight must land before we read it back
            view = self._current_view()
            rec = view.record(idx)
            if rec is not None and start < self.size:
                fill = min(cs, self.size - start)
                valid = valid_bytes(rec, idx, cs, view.size)
                if valid:
                    # The whole stored chunk, also where the file ends inside
                    # it (a truncate keeps the longer stored chunk): these
                    # bytes go into the chunk's next generation, and a read
                    # of a whole chunk is checked against the record's CRC32C
                    # every time, a partial one only when its STATs answer
                    # in time (docs/client.md, "Read path").
                    await self._client._read_chunk(view, idx, rec, 0, rec.length, buf[: rec.length])
                # Past the valid bytes: zeros (the stored chunk's bytes there
                # are not the file's).
                end = max(fill, rec.length if valid else 0)
                if end > valid:
                    _zero(buf[valid:end])
        except BaseException:
            pool.put(buf)
            raise
        return _Staging(idx, buf, fill)

    async def _stage_out(self) -> None:
        st, self._staging = self._staging, None
        if st is None:
            return
        if st.fill == 0:
            self._client.pool.put(st.buf)
            return
        st.buf[st.fill:] = bytes(len(st.buf) - st.fill)
        await self._wait_chunk(st.idx)
        await self._submit(st.idx, None, st, crc32c(st.buf[: st.fill]))

    async def _submit(self, idx: int, frags: list[memoryview] | None, st: _Staging | None, crc: int) -> None:
        await self._slots.acquire()
        seq = self._uploads.get(idx, 0)
        if self._error is None and seq > MAX_UPLOAD_SEQ:
            self._error = InvalidArgumentError(
                f"{self.path}: chunk {idx} was uploaded {seq} times in this write session (at most "
                f"{MAX_UPLOAD_SEQ + 1}): close the file and open it again")
        if self._error is not None:
            self._slots.release()
            if st is not None:
                self._client.pool.put(st.buf)
            raise self._error
        assert self._session is not None
        self._uploads[idx] = seq + 1
        gen = generation(self._session.data_version, seq)
        length = st.fill if st is not None else self._view.chunk_size
        task = asyncio.get_running_loop().create_task(self._upload(idx, gen, length, crc, frags, st))
        self._inflight[idx] = task
        # Told to meta at the next renewal, before it is known to be stored:
        # a writer that dies mid-chunk leaves nothing unaccounted.
        self._unreported.append((idx, gen))

    async def _upload(self, idx: int, gen: int, length: int, crc: int, frags: list[memoryview] | None,
                      st: _Staging | None) -> None:
        client = self._client
        view = self._view
        try:
            if frags is None:
                assert st is not None
                frags = view.codec.encode(st.buf, st.fill, view.chunk_size)
                if not view.codec.replicated:  # EC fragments no longer reference the buffer
                    client.pool.put(st.buf)
                    st = None
            missing, placed = await client._write_chunk(view, idx, gen, frags)
            self._written[idx] = ChunkRecord(gen, length, length, crc, tuple(missing))
            self._placed[idx] = placed
            self._unstaged.add(idx)
        except TierFSError as exc:
            if self._error is None:
                self._error = exc
        finally:
            if st is not None:
                client.pool.put(st.buf)
            self._slots.release()
            if self._inflight.get(idx) is asyncio.current_task():
                del self._inflight[idx]

    async def flush(self) -> None:
        """Make everything written so far durable on the storage targets."""
        self._check_open()
        if not self._writable:
            return
        if self._staging is not None:
            await self._stage_out()
        if self._inflight:
            await asyncio.wait(list(self._inflight.values()))
        if self._error is not None:
            raise self._error

    async def _renew_loop(self) -> None:
        cfg = self._client.config
        while True:
            await asyncio.sleep(cfg.lease_ms / 3000)
            try:
                await self._renew()
            except SessionExpiredError as exc:
                self._error = self._error or exc
                return
            except TierFSError:
                pass  # meta unreachable for now: what was not sent is sent at the next renewal

    async def _renew(self, *, keep: bool = False,
                     until: float | None = None) -> tuple[list[tuple[int, int]], list[pb.ChunkRecord]]:
        """Renew the lease, telling meta of the uploads begun and staging the
        records of the chunks stored since the last renewal, in requests of
        at most ``MAX_CHUNKS_PER_REQUEST`` of each (a session may write any
        number of chunks; every request stays small). An item leaves the
        backlog only once meta has it, so a renewal that fails or is
        cancelled loses nothing. ``keep``: the last batch is not sent but
        returned, for the commit or abort to carry. ``until``: the loop time
        by which it gives up (the abort's bound; None: meta's deadline per
        request)."""
        assert self._session is not None
        sid, cfg, n = self._session.session_id, self._client.config, MAX_CHUNKS_PER_REQUEST
        async with self._renew_lock:
            while True:
                ups = self._unreported[:n]
                sent = {i: self._written[i] for i in sorted(self._unstaged)[:n]}
                recs = [rec.fill_pb(pb.ChunkRecord(), i) for i, rec in sent.items()]
                last = len(self._unreported) <= n and len(self._unstaged) <= n
                if keep and last:
                    return ups, recs
                await self._client.meta.renew_lease(sid, uploads=ups, lease_ms=cfg.lease_ms, chunks=recs,
                                                    deadline=_left(until))
                del self._unreported[: len(ups)]  # uploads begun meanwhile were appended after them
                for i, rec in sent.items():
                    if self._written[i] is rec:  # not stored again meanwhile
                        self._unstaged.discard(i)
                if last:
                    return [], []

    # ---- closing ----------------------------------------------------------------

    async def close(self) -> None:
        """Publish the file (writers) and release everything."""
        if self.closed:
            return
        if not self._writable:
            await self._drop_ahead()
            self._finish()
            return
        try:
            await self.flush()
            await self._zero_replaced_holes()
            assert self._session is not None
            for attempt in range(_COMMIT_TRIES):
                # A retry re-sends with the lease renewed meanwhile, as the
                # first try does: the re-send can outlast a lease (a slow or
                # stalled new member, many moved chunks).
                self._start_renewer()
                # Fragments whose group member changed during the session
                # (rebalance moves, drains) go to the current members first.
                await self._settle_moves(force=attempt > 0)
                await self._stop_renewer()
                # Meta has staged the records renewals sent; the rest (and the
                # uploads no renewal reported) come with the commit.
                ups, recs = await self._renew(keep=True)
                try:
                    info = await self._client.meta.commit_write(self._session.session_id, self.size, recs,
                                                                uploads=ups, map_version=self.map_version)
                    break
                except StaleVersionError as exc:
                    # Members moved between our look at the map and the
                    # commit, leaving too few fragments on current ones.
                    if attempt == _COMMIT_TRIES - 1:
                        raise StaleVersionError(f"{self.path}: the placement of its chunks kept changing while "
                                                f"it was committed ({_COMMIT_TRIES} attempts): {exc}") from exc
                    log.info("%s: commit refused as stale (%s); sending moved fragments again", self.path, exc)
            self.size = info.attr.size
        except BaseException:
            await self.abort()
            raise
        self._finish()

    async def _zero_replaced_holes(self) -> None:
        """A ``w`` session over old contents: each old chunk under the new
        size that this session did not write (a hole it seeked over) is
        written as zeros, so the commit leaves none of the old bytes. The
        commit drops the old chunks past the new size."""
        if not self._replaced:
            return
        cs = self._view.chunk_size
        holes = sorted(i for i in self._replaced if i * cs < self.size and i not in self._written)
        self._replaced = set()
        for idx in holes:
            buf = self._client.pool.get(self._view.codec.encode_size(cs))
            fill = min(cs, self.size - idx * cs)
            _zero(buf[:fill])
            self._staging = _Staging(idx, buf, fill)
            await self._stage_out()
        if holes:
            await self.flush()

    async def _settle_moves(self, *, force: bool) -> None:
        """Bring every chunk this session stored onto its group's members in
        a fresh map (``AsyncClient._resend_moved`` re-sends the fragments of
        the positions that moved) and take that map's version as the one
        the commit names. ``force``: fetch the map even within
        ``map_refresh_interval`` (after a commit refused as stale)."""
        if not self._written:
            return
        client, view = self._client, self._view
        version, groups = await client.current_placement(force=force)
        jobs = []
        for idx in sorted(self._written):
            members = groups.get(view.groups[idx % len(view.groups)])
            if members is None or len(members) != len(self._placed[idx]):
                raise StaleVersionError(f"{self.path}: chunk {idx}: group {view.groups[idx % len(view.groups)]} is "
                                        f"not in cluster map version {version} with width {len(self._placed[idx])}")
            if moved_positions(self._placed[idx], members, self._written[idx].missing):
                jobs.append(functools.partial(self._resend, idx, members))
        err = first_error(await ordered(jobs, client.config.write_concurrency))
        if err is not None:
            raise err
        self.map_version = version

    async def _resend(self, idx: int, members: tuple[int, ...]) -> None:
        rec = self._written[idx]
        new = await self._client._resend_moved(self._view, idx, rec, self._placed[idx], members)
        self._placed[idx] = members
        if new != rec:
            self._written[idx] = new
            self._unstaged.add(idx)  # meta staged the record before: it gets the new one

    async def abort(self) -> None:
        """Drop what this writer wrote (nothing of it becomes visible)."""
        if self.closed:
            return
        self._finish()
        if self._inflight:
            for t in self._inflight.values():
                t.cancel()
            await asyncio.wait(list(self._inflight.values()))
        await self._stop_renewer()
        if self._session is not None:
            # Best effort, and bounded by ``abort_deadline`` rather than meta's
            # deadline (twice over: the renewal, then the abort): an abort
            # that never reaches meta loses nothing, as the lease expires and
            # meta takes the reported uploads to GC, scrub the rest as orphans.
            until = asyncio.get_running_loop().time() + self._client.config.abort_deadline
            try:
                ups, _ = await self._renew(keep=True, until=until)  # every upload to meta, so that all go to GC
                await self._client.meta.abort_write(self._session.session_id, uploads=ups, deadline=_left(until))
                if self._created:
                    await _remove_created(self._client, self.path, self._created)
            except TierFSError as exc:
                # Unreachable meta: say so (the file stays busy for other
                # writers until the lease runs out). Anything else (the
                # session already expired, say) leaves nothing to end.
                level = logging.WARNING if isinstance(exc, UnavailableError | TimeoutError_) else logging.DEBUG
                log.log(level, "%s: the aborted write session %d could not be ended (%s); meta ends it when its "
                        "lease expires", self.path, self._session.session_id, exc)

    async def _drop_ahead(self) -> None:
        loads = [t for t, _ in self._chunks.values() if not t.done()]
        for idx in list(self._chunks):
            self._drop_chunk(idx)
        if loads:
            await asyncio.gather(*loads, return_exceptions=True)

    def _finish(self) -> None:
        self.closed = True
        if self._client._cap_renewers.get(self.inode) == self._renew:
            del self._client._cap_renewers[self.inode]
        pool = self._client.pool
        for idx in list(self._chunks):
            self._drop_chunk(idx)
        if self._staging is not None:
            pool.put(self._staging.buf)
            self._staging = None

    def _start_renewer(self) -> None:
        if self._renewer is None and self._error is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew_loop())

    async def _stop_renewer(self) -> None:
        t, self._renewer = self._renewer, None
        if t is not None:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, TierFSError):
                await t

    async def __aenter__(self) -> AsyncFile:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if e is not None and self._writable:
            await self.abort()
        else:
            await self.close()

    def __repr__(self) -> str:
        return f"<tierfs AsyncFile {self.path!r} mode={self.mode!r} pos={self.pos} size={self.size}>"

