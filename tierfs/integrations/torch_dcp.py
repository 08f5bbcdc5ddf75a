"""PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``) on TierFS
(docs/training.md): :class:`TierFSStorageWriter` and
:class:`TierFSStorageReader`, for ``dcp.save`` / ``dcp.load``.

The on-storage layout is DCP's own ``FileSystemWriter`` layout (default
``TORCH_SAVE`` format): per rank, a few ``.distcp`` data files holding the
non-tensor items' bytes and each tensor as ``torch.save`` output, and a
``.metadata`` file that is a pickled :class:`Metadata` whose ``storage_data``
maps each item to a ``_StorageInfo(relative_path, offset, length)``. A
checkpoint copied to local disk therefore loads with ``FileSystemReader``,
and one written by ``FileSystemWriter`` (``TORCH_SAVE`` or ``SAFETENSORS``
format) and uploaded into TierFS loads with :class:`TierFSStorageReader`.

Writes: ``torch.save`` hands its stream each tensor's storage as one
memoryview of the tensor's own memory, which goes straight to the client's
striped writer (no serialized copy of the tensor, let alone of the file);
a rank writes several files at once. Reads: the small zip records around a
tensor (the head and the central directory of its ``torch.save`` slice) are
read and parsed here, then the tensor's bytes are read straight into the
destination tensor that the planner hands out, when it is contiguous and of
the stored dtype (otherwise into a scratch tensor, then copied).

Atomicity: data files get names unique to the save; ``.metadata`` is written
under a temporary name and renamed over the old one (TierFS rename replaces
a file atomically) only after every rank's files are committed, and the
previous checkpoint's data files are removed only after that. A save that
dies midway leaves the previous checkpoint as it was; a directory that has
data files but no ``.metadata`` reads as an incomplete checkpoint.

torch is imported by this module; install the ``tierfs[torch]`` extra."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import io
import math
import os
import pickle
import struct
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch  # type: ignore[import-not-found,unused-ignore]
from torch.distributed.checkpoint import (  # type: ignore[import-not-found,unused-ignore]
    StorageReader,
    StorageWriter,
)
from torch.distributed.checkpoint.filesystem import (  # type: ignore[import-not-found,unused-ignore]
    CURRENT_DCP_VERSION,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import StorageMeta  # type: ignore[import-not-found,unused-ignore]
from torch.distributed.checkpoint.planner import (  # type: ignore[import-not-found,unused-ignore]
    LoadItemType,
    ReadItem,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult  # type: ignore[import-not-found,unused-ignore]
from torch.futures import Future  # type: ignore[import-not-found,unused-ignore]

from tierfs.client import AsyncClient, Client
from tierfs.client.client import FileView
from tierfs.errors import (
    ConfigError,
    CorruptError,
    InvalidArgumentError,
    NotFoundError,
    TierFSError,
)
from tierfs.integrations.common import CONNECT_TIMEOUT, resolve
from tierfs.integrations.safetensors import parse_header
from tierfs.kv.keys import byte_view

__all__ = ["METADATA_NAME", "ReadStats", "TierFSStorageReader", "TierFSStorageWriter", "tierfs_path"]

#: The committed metadata's name, as DCP's FileSystemWriter names it.
METADATA_NAME = ".metadata"
DATA_SUFFIX = ".distcp"
#: Tensors (or byte items) one rank reads at once; each read is itself
#: spread over chunks and storage nodes by the client.
READ_CONCURRENCY = 16
#: The first read of a torch.save slice: its zip records before the
#: tensor's bytes (a pickle of a few hundred bytes and small records).
HEAD_WINDOW = 4096
#: The last read of a slice: the zip's central directory and end records.
TAIL_WINDOW = 4096
#: Writes smaller than this are gathered (COALESCE bytes at most) before
#: they go to the file.
SMALL_WRITE = 64 << 10
COALESCE = 1 << 20
#: Slices up to this size are read whole, neighbours together: runs of at
#: most RUN_MAX bytes, skipping gaps of at most RUN_GAP.
SMALL_SLICE = 64 << 10
RUN_MAX = 4 << 20
RUN_GAP = 64 << 10


def tierfs_path(path: str | os.PathLike[str]) -> str:
    """``/a/b``, ``tierfs:///a/b`` or ``tierfs://a/b`` -> ``/a/b`` (as the
    ``tierfs://`` fsspec filesystem names paths)."""
    s = os.fspath(path)
    if not isinstance(s, str):
        raise InvalidArgumentError(f"checkpoint path must be a string, not {type(s).__name__}")
    if s.startswith("tierfs://"):
        s = "/" + s[len("tierfs://"):].lstrip("/")
    elif "://" in s:
        raise InvalidArgumentError(f"{s!r} is not a TierFS path (use /dir or tierfs:///dir)")
    if not s.startswith("/"):
        raise InvalidArgumentError(f"checkpoint path {s!r} must be absolute (/dir or tierfs:///dir)")
    parts = [p for p in s.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidArgumentError(f"checkpoint path {s!r} must not contain '..'")
    return "/" + "/".join(parts)


def _join(d: str, name: str) -> str:
    return d.rstrip("/") + "/" + name


def _connect(client: Client | None, meta: Sequence[str] | str | None, who: str) -> tuple[Client, bool]:
    """The client to use and whether this object owns it (made it here)."""
    if client is not None:
        if not isinstance(client, Client):
            raise InvalidArgumentError(f"{who} needs a blocking tierfs Client, not {type(client).__name__}")
        return client, False
    target = resolve({"meta": meta}, meta_key="meta", pool_key="pool", where=who)
    c = Client(list(target.meta), meta_deadline=CONNECT_TIMEOUT)
    try:
        c.exists("/")
    except (TierFSError, OSError, TimeoutError) as e:
        c.close()
        raise ConfigError(f"cannot reach the TierFS cluster at {','.join(target.meta)} within "
                          f"{CONNECT_TIMEOUT:g} s ({type(e).__name__}: {e})", field=target.meta_setting) from e
    except BaseException:
        c.close()
        raise
    return c, True


#: Clients of unpickled writers and readers, one per set of client
#: arguments in a process (see :func:`_client_for`).
_UNPICKLED: dict[bytes, Client] = {}
_UNPICKLED_LOCK = threading.Lock()


def _client_for(args: Any) -> Client:
    """The client an unpickled writer or reader uses: one per process and
    set of client arguments, made on first use and reused by every later
    copy (DCP's process-based ``async_save`` sends the writer to its
    checkpoint process once per save); closed at interpreter exit, as every
    client is."""
    key = pickle.dumps(args)
    with _UNPICKLED_LOCK:
        c = _UNPICKLED.get(key)
        if c is None or c._closed:
            meta, config, options = args
            c = _UNPICKLED[key] = Client(meta, config=config, **options)
        return c


class _Picklable:
    """Pickling for the writer and the reader: DCP's process-based
    ``async_save`` (``AsyncCheckpointerType.PROCESS``) pickles the writer
    into its checkpoint process. The client is not pickled (its loop
    thread and channels cannot be); the copy connects with the same
    arguments (:func:`_client_for`) and does not close that client."""

    client: Client
    _owns: bool

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["client"] = None
        state["_owns"] = False
        state["_client_args"] = self.client._args
        if "_st_headers" in state:  # the reader's per-load futures
            state["_st_headers"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        args = state.pop("_client_args")
        self.__dict__.update(state)
        self.client = _client_for(args)


def _is_data_leftover(name: str) -> bool:
    """Files a save of this directory may leave: data files, and the
    metadata's temporary name."""
    return name.endswith(DATA_SUFFIX) or (name.startswith(METADATA_NAME + ".") and name.endswith(".tmp"))


@dataclasses.dataclass(frozen=True)
class _Prefix:
    """A rank's data-file name prefix, set by the coordinator."""

    prefix: str


class _Stopped(Exception):
    """A data file's write stopped because another file of the save failed."""


class _Sink:
    """The stream ``torch.save`` writes to: a TierFS file. Small writes (zip
    records of a few dozen bytes, small tensors) are gathered into one
    buffer, since each call to the file is a hop to the client's loop
    thread; large ones (a tensor's storage) go to the file as they are,
    from the tensor's memory. ``flush`` does nothing: torch flushes after
    every save, and a TierFS flush would upload the partial chunk (and later
    again) once per tensor. :meth:`drain` before closing."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.pos = int(f.tell())
        self.buf = bytearray()
        #: The first error of a write to the file. torch.save's zip writer
        #: goes on to write its end records after it and fails with its own
        #: "unexpected pos" error, the only one DCP shows: :meth:`check`
        #: raises this one instead.
        self.error: BaseException | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n < SMALL_WRITE:
            self.buf += view
            if len(self.buf) >= COALESCE:
                self.drain()
        else:
            self.drain()
            self._write(view)
        self.pos += n
        return n

    def _write(self, data: Any) -> None:
        if self.error is not None:
            raise self.error
        try:
            self.f.write(data)
        except BaseException as exc:
            self.error = exc
            raise

    def drain(self) -> None:
        if self.buf:
            # The file copies or encodes what it is given before write
            # returns, so the buffer is free again; a new one is simplest.
            self._write(self.buf)
            self.buf = bytearray()

    def check(self, exc: BaseException) -> None:
        """Re-raise the file's own error if ``exc`` came after one."""
        if self.error is not None and exc is not self.error:
            raise self.error from exc

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


def _item_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    return math.prod(td.size) * torch._utils._element_size(td.properties.dtype) if td is not None else 0


def _buckets(n: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """Items into ``n`` files of about equal bytes (largest first into the
    lightest), byte items spread round-robin; empty files are dropped."""
    out: list[list[WriteItem]] = [[] for _ in range(n)]
    sizes = [0] * n
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_nbytes, reverse=True)
    for k, item in enumerate(byte_items):
        out[k % n].append(item)
    for item in tensors:
        j = min(range(n), key=sizes.__getitem__)
        out[j].append(item)
        sizes[j] += _item_nbytes(item)
    return [b for b in out if b]


async def _rm_all(ac: AsyncClient, paths: list[str]) -> None:
    """Remove ``paths`` at once (each is one metadata op); gone already is fine."""
    async def rm(p: str) -> None:
        with contextlib.suppress(NotFoundError):
            await ac.rm(p)

    await asyncio.gather(*(rm(p) for p in paths))


class TierFSStorageWriter(_Picklable, StorageWriter):  # type: ignore[misc]
    """A DCP ``StorageWriter`` saving into TierFS directory ``path`` (``/dir``
    or ``tierfs:///dir``). ``client``: a blocking :class:`Client` to use
    (not closed here); else one is made on ``meta`` (addresses, or
    ``TIERFS_META``) and closed by :meth:`close`. ``thread_count``: files
    each rank writes at once (its items are split among them by size).
    ``overwrite=False`` refuses a path that already holds a checkpoint."""

    def __init__(self, path: str | os.PathLike[str], *, client: Client | None = None,
                 meta: Sequence[str] | str | None = None, thread_count: int = 4, overwrite: bool = True) -> None:
        super().__init__()
        if thread_count < 1:
            raise InvalidArgumentError(f"thread_count must be at least 1, not {thread_count}")
        self.path = tierfs_path(path)
        self.thread_count = thread_count
        self.overwrite = overwrite
        self.client, self._owns = _connect(client, meta, "TierFSStorageWriter")
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = False
        self.rank: int | None = None
        #: Tensors that had to be copied before writing (a view into a
        #: larger storage, or not on the CPU), in the last write_data.
        self.copied_tensors = 0

    # ---- StorageWriter --------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = tierfs_path(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            tierfs_path(checkpoint_id)
        except InvalidArgumentError:
            return False
        return True

    def storage_meta(self) -> Any:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise InvalidArgumentError("TierFSStorageWriter needs use_collectives=True: it commits one "
                                       ".metadata for all ranks")
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")

    def prepare_local_plan(self, plan: Any) -> Any:
        if self.is_coordinator:
            self.client.mkdir(self.path, parents=True, exist_ok=True)
            if not self.overwrite and self.client.exists(_join(self.path, METADATA_NAME)):
                raise InvalidArgumentError(f"a checkpoint already exists at tierfs {self.path} "
                                           f"and overwrite=False")
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        # One tag for the whole save: its files never collide with those of
        # the checkpoint they replace, which stays loadable until the commit.
        tag = self.save_id.replace("-", "")[:12]
        return [dataclasses.replace(p, storage_data=_Prefix(f"__{i}_{tag}_")) for i, p in enumerate(plans)]

    def write_data(self, plan: Any, planner: Any) -> Any:
        prefix: _Prefix = plan.storage_data
        self.copied_tensors = 0
        buckets = _buckets(self.thread_count, list(plan.items))
        names = [f"{prefix.prefix}{n}{DATA_SUFFIX}" for n in range(len(buckets))]
        lock = threading.Lock()
        # torch's planner hands out data from several threads in its own
        # FileSystemWriter too; one lock keeps resolve_data itself serial.
        results: list[WriteResult] = []
        if len(buckets) <= 1:
            for name, items in zip(names, buckets, strict=True):
                results += self._write_file(name, items, planner, lock)
        else:
            # When one file fails the others stop at their next item (until
            # stop 48 they wrote on to the end, for a save already lost).
            stop = threading.Event()
            with concurrent.futures.ThreadPoolExecutor(len(buckets), thread_name_prefix="tierfs-dcp") as ex:
                futs = [ex.submit(self._write_file, name, items, planner, lock, stop)
                        for name, items in zip(names, buckets, strict=True)]
                concurrent.futures.wait(futs)
            errors = [f.exception() for f in futs]
            first = next((e for e in errors if e is not None and not isinstance(e, _Stopped)), None)
            if first is not None:
                raise first
            for f in futs:
                results += f.result()
        fut: Any = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, name: str, items: list[WriteItem], planner: Any, lock: threading.Lock,
                    stop: threading.Event | None = None) -> list[WriteResult]:
        out: list[WriteResult] = []

        def go_on() -> None:
            if stop is not None and stop.is_set():
                raise _Stopped(f"{name}: another file of this rank's save failed")

        with self.client.open(_join(self.path, name), "wb") as f:  # an exception aborts the file
            try:
                return self._write_items(f, name, items, planner, lock, go_on, out)
            except BaseException:
                if stop is not None:
                    stop.set()  # at once, not after this file's abort: the others stop at their next item
                raise

    def _write_items(self, f: Any, name: str, items: list[WriteItem], planner: Any, lock: threading.Lock,
                     go_on: Callable[[], None], out: list[WriteResult]) -> list[WriteResult]:
        sink = _Sink(f)
        for item in items:
            if item.type != WriteItemType.BYTE_IO:
                continue
            go_on()
            with lock:
                data = planner.resolve_data(item)
            buf = data.getbuffer()
            off = sink.tell()
            sink.write(buf)
            out.append(WriteResult(index=item.index, size_in_bytes=len(buf),
                                   storage_data=_StorageInfo(name, off, len(buf))))
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            go_on()
            with lock:
                t = planner.resolve_data(item).detach()
            if t.device.type != "cpu":
                t = t.cpu()
                with lock:
                    self.copied_tensors += 1
            elif t.untyped_storage().nbytes() != t.numel() * t.element_size():
                # torch.save writes a tensor's whole storage: a view
                # into a larger one is packed first (as DCP does).
                t = t.clone()
                with lock:
                    self.copied_tensors += 1
            off = sink.tell()
            try:
                torch.save(t, sink)  # the storage goes to f.write as one memoryview of its memory
            except Exception as exc:
                sink.check(exc)
                raise
            length = sink.tell() - off
            out.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(name, off, length)))
        sink.drain()
        return out

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rank in results for wr in rank}
        metadata.storage_meta = self.storage_meta()
        keep = {si.relative_path for si in metadata.storage_data.values()}
        final = _join(self.path, METADATA_NAME)
        tmp = _join(self.path, f"{METADATA_NAME}.{self.save_id.replace('-', '')[:12]}.tmp")
        self.client.write_bytes(tmp, pickle.dumps(metadata))  # durable once written
        self.client.rename(tmp, final)  # the commit: replaces the old .metadata atomically
        # The previous checkpoint (and any save that died before its
        # commit) is garbage now.
        stale = [_join(self.path, n) for n in self.client.ls(self.path) if _is_data_leftover(n) and n not in keep]
        self.client._run(_rm_all(self.client.aclient, stale))

    # ---- lifetime -------------------------------------------------------------

    def close(self) -> None:
        """Close the client if this writer made it."""
        if self._owns:
            self.client.close()

    def __enter__(self) -> TierFSStorageWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- reading -------------------------------------------------------------------


@dataclasses.dataclass
class ReadStats:
    """How the last ``read_data`` placed each tensor read."""

    #: Read straight into the destination tensor's memory.
    direct: int = 0
    #: Read into a scratch tensor, then copied (destination not contiguous,
    #: of another dtype, or the stored region not contiguous).
    copied: int = 0
    #: Small slices (at most SMALL_SLICE bytes): read whole in one request,
    #: the tensor copied out of that buffer.
    small: int = 0
    #: Not a layout recognized here: the slice read whole and ``torch.load``ed.
    loaded: int = 0
    bytes_read: int = 0


class _Unrecognized(Exception):
    """A slice this module does not parse; it takes the torch.load path."""


@dataclasses.dataclass(frozen=True)
class _Stored:
    """Where a stored tensor's elements are: the file offset of its storage,
    and the tensor's dtype, size, stride and offset in that storage."""

    data_offset: int
    storage_numel: int
    dtype: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    #: A small slice held whole in memory (it starts at file offset
    #: ``base``): the tensor is copied out of it, not read again.
    raw: bytearray | None = None
    base: int = 0


class _StorageRef:
    def __init__(self, dtype: Any) -> None:
        self.dtype = dtype


class _TensorRef:
    def __init__(self, pid: Any, storage_offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.pid, self.storage_offset, self.size, self.stride = pid, storage_offset, tuple(size), tuple(stride)


def _rebuild(storage: Any, storage_offset: int, size: Any, stride: Any, *rest: Any) -> _TensorRef:
    return _TensorRef(storage, storage_offset, size, stride)


class _Unpickler(pickle.Unpickler):
    """Reads ``data.pkl`` of a plain tensor's ``torch.save`` without making
    the tensor: only the names such a pickle uses are allowed."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage"):
            if name == "UntypedStorage":
                return _StorageRef(torch.uint8)
            try:
                return _StorageRef(torch.storage._get_dtype_from_pickle_storage_type(name))
            except (KeyError, AttributeError) as e:
                raise _Unrecognized(name) from e
        raise _Unrecognized(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid


def _zip_entries(tail: bytes | bytearray, tail_start: int) -> dict[str, tuple[int, int]]:
    """Central directory of a zip whose last bytes are ``tail`` (starting at
    slice offset ``tail_start``): name -> (local header offset, size)."""
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0 or len(tail) - eocd < 22:
        raise _Unrecognized("no end of central directory")
    n, cd_size, cd_off = struct.unpack_from("<HII", tail, eocd + 10)
    if cd_off == 0xFFFFFFFF or n == 0xFFFF or cd_size == 0xFFFFFFFF:
        loc = tail.rfind(b"PK\x06\x07", 0, eocd)
        if loc < 0:
            raise _Unrecognized("zip64 without a locator")
        (z64,) = struct.unpack_from("<Q", tail, loc + 8)
        rel = z64 - tail_start
        if rel < 0 or tail[rel:rel + 4] != b"PK\x06\x06":
            raise _Unrecognized("zip64 end record out of reach")
        n, cd_size, cd_off = struct.unpack_from("<QQQ", tail, rel + 32)
    pos = cd_off - tail_start
    if pos < 0:
        raise _Unrecognized("central directory out of reach")
    out: dict[str, tuple[int, int]] = {}
    for _ in range(n):
        if tail[pos:pos + 4] != b"PK\x01\x02":
            raise _Unrecognized("bad central directory entry")
        (method, csize, usize, nl, el, cl) = struct.unpack_from("<H8xIIHHH", tail, pos + 10)
        (lho,) = struct.unpack_from("<I", tail, pos + 42)
        name = tail[pos + 46:pos + 46 + nl].decode("utf-8", "replace")
        extra = tail[pos + 46 + nl:pos + 46 + nl + el]
        if method != 0:
            raise _Unrecognized(f"compressed zip record {name}")
        if 0xFFFFFFFF in (usize, csize, lho):
            e = 0
            while e + 4 <= len(extra):
                tag, sz = struct.unpack_from("<HH", extra, e)
                if tag == 1:
                    vals = list(struct.unpack_from(f"<{sz // 8}Q", extra, e + 4))
                    if usize == 0xFFFFFFFF:
                        usize = vals.pop(0)
                    if csize == 0xFFFFFFFF:
                        csize = vals.pop(0)
                    if lho == 0xFFFFFFFF:
                        lho = vals.pop(0)
                    break
                e += 4 + sz
        out[name] = (lho, usize)
        pos += 46 + nl + el + cl
    return out


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(size):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def _is_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    return all(sz <= 1 or st == c for sz, st, c in zip(size, stride, _contiguous_strides(size), strict=True))


def _region(st: _Stored, offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int] | None:
    """The element range [first, count) of the box ``offsets``/``lengths``
    of a contiguous stored tensor when the box is one run of elements."""
    if not _is_contiguous(st.size, st.stride):
        return None
    size = st.size
    if len(offsets) != len(size):
        return None
    # Contiguous iff every dim after the first one taken partially is taken
    # whole, and every dim before it has length 1.
    d = 0
    while d < len(size) and lengths[d] == 1:
        d += 1
    if any(lengths[k] != size[k] for k in range(d + 1, len(size))):
        return None
    first = st.storage_offset + sum(o * s for o, s in zip(offsets, _contiguous_strides(size), strict=True))
    return first, math.prod(lengths)


class _Run:
    """Neighbouring small slices of one file, read in one request."""

    def __init__(self, start: int, length: int) -> None:
        self.start, self.length = start, length
        self.task: asyncio.Future[bytearray] | None = None


class _Snapshot:
    """One data file looked up once; every read sees that version."""

    def __init__(self, reader: TierFSStorageReader, path: str) -> None:
        self.reader, self.path = reader, path
        self.view: FileView | None = None
        self._lock = asyncio.Lock()
        #: Small slices (offset, length) to be read, and the run each is in.
        self.wanted: list[tuple[int, int]] = []
        self._runs: dict[tuple[int, int], _Run] = {}

    def plan_runs(self) -> None:
        """Group the wanted small slices into runs of at most RUN_MAX bytes
        with gaps of at most RUN_GAP: a thousand small tensors of a file are
        then a few reads, not a thousand."""
        run: _Run | None = None
        for off, n in sorted(set(self.wanted)):
            if run is not None and off - (run.start + run.length) <= RUN_GAP and off + n - run.start <= RUN_MAX:
                run.length = max(run.length, off + n - run.start)
            else:
                run = _Run(off, n)
            self._runs[(off, n)] = run

    async def small_bytes(self, offset: int, n: int) -> bytearray:
        run = self._runs.get((offset, n))
        if run is None:
            return await self.read_bytes(offset, n)
        if run.task is None:
            run.task = asyncio.ensure_future(self.read_bytes(run.start, run.length))
        buf = await run.task
        return buf[offset - run.start: offset - run.start + n]

    async def _view(self) -> FileView:
        async with self._lock:
            if self.view is None:
                ac = self.reader.client.aclient
                self.view = FileView.of(self.path, await ac.meta.stat(self.path))
            return self.view

    async def size(self) -> int:
        return (await self._view()).size

    async def read(self, offset: int, dest: memoryview) -> None:
        view = await self._view()
        n, self.view = await self.reader.client.aclient._read_fresh(view, offset, dest)
        if n != len(dest):
            raise InvalidArgumentError(f"tierfs {self.path}: read {n} of {len(dest)} bytes at offset {offset} "
                                       f"(the file is shorter than the checkpoint's metadata says)")
        self.reader.stats.bytes_read += n

    async def read_bytes(self, offset: int, n: int) -> bytearray:
        buf = bytearray(n)
        if n:
            await self.read(offset, memoryview(buf))
        return buf


class TierFSStorageReader(_Picklable, StorageReader):  # type: ignore[misc]
    """A DCP ``StorageReader`` loading the checkpoint in TierFS directory
    ``path``: one written by :class:`TierFSStorageWriter`, or by DCP's
    ``FileSystemWriter`` (``TORCH_SAVE`` or ``SAFETENSORS`` format) and
    copied into TierFS. ``client``/``meta`` as for the writer."""

    def __init__(self, path: str | os.PathLike[str], *, client: Client | None = None,
                 meta: Sequence[str] | str | None = None) -> None:
        super().__init__()
        self.path = tierfs_path(path)
        #: the directory the metadata was read from, symbolic links followed
        #: (a "latest" link): data files are read from the same one even if
        #: the link is moved to a newer checkpoint meanwhile
        self._dir = self.path
        self.client, self._owns = _connect(client, meta, "TierFSStorageReader")
        self.storage_data: dict[Any, Any] = {}
        self.metadata: Any = None
        self.load_id = str(uuid.uuid4())
        self.stats = ReadStats()
        self._st_headers: dict[tuple[str, int], asyncio.Future[Any]] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = tierfs_path(checkpoint_id)
        self._dir = self.path
        self.load_id = str(uuid.uuid4())

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return TierFSStorageWriter.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self) -> Any:
        try:
            self._dir = self.client.resolve(self.path)
            raw = self.client.read_bytes(_join(self._dir, METADATA_NAME))
        except NotFoundError:
            raise self._why_missing() from None
        try:
            md = pickle.loads(raw)
        except Exception as exc:  # (an AssertionError of DCP's naming no file, until stop 47)
            raise CorruptError(f"tierfs {_join(self._dir, METADATA_NAME)}: not a checkpoint's metadata "
                               f"({len(raw)} bytes; {type(exc).__name__}: {exc})") from None
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def _why_missing(self) -> Exception:
        try:
            names = self.client.ls(self.path)
        except NotFoundError:
            return NotFoundError(f"no checkpoint at tierfs {self.path}: the directory does not exist")
        left = [n for n in names if _is_data_leftover(n)]
        if left:
            return NotFoundError(f"the checkpoint at tierfs {self.path} is incomplete: it has {len(left)} data "
                                 f"file(s) but no committed {METADATA_NAME} (a save that did not finish)")
        return NotFoundError(f"no checkpoint at tierfs {self.path}: it has no {METADATA_NAME}")

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata
        self.storage_data = metadata.storage_data
        if self.storage_data is None:
            raise InvalidArgumentError(f"tierfs {self.path}: the checkpoint's metadata has no storage_data")

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Any:
        self.stats = ReadStats()
        jobs: list[tuple[ReadItem, Any]] = []
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                jobs.append((req, None))
            else:
                jobs.append((req, planner.resolve_tensor(req).detach()))
        got = self.client._run(self._read_all(jobs))
        for (req, target), data in zip(jobs, got, strict=True):
            if target is None:
                assert data is not None
                planner.load_bytes(req, io.BytesIO(data))
            else:
                planner.commit_tensor(req, target)
        fut: Any = Future()
        fut.set_result(None)
        return fut

    async def _read_all(self, jobs: list[tuple[ReadItem, Any]]) -> list[bytearray | None]:
        files: dict[str, _Snapshot] = {}
        parsed: dict[Any, asyncio.Future[Any]] = {}
        self._st_headers = {}
        slots = asyncio.Semaphore(READ_CONCURRENCY)

        def snap(rel: str) -> _Snapshot:
            if rel not in files:
                files[rel] = _Snapshot(self, _join(self._dir, rel))
            return files[rel]

        for req, target in jobs:
            info = self.storage_data[req.storage_index]
            if target is None or info.length <= SMALL_SLICE:
                snap(info.relative_path).wanted.append((info.offset, info.length))
        for f in files.values():
            f.plan_runs()

        async def one(req: ReadItem, target: Any) -> bytearray | None:
            info = self.storage_data[req.storage_index]
            f = snap(info.relative_path)
            async with slots:
                if target is None:
                    return await f.small_bytes(info.offset, info.length)
                key = req.storage_index
                if key not in parsed:
                    parsed[key] = asyncio.ensure_future(self._locate(f, info, req))
                stored = await parsed[key]
                await self._read_tensor(f, info, req, target, stored)
                return None

        return list(await asyncio.gather(*(one(r, t) for r, t in jobs)))

    async def _locate(self, f: _Snapshot, info: Any, req: ReadItem) -> _Stored | bytearray:
        """Where the tensor of slice ``info`` lies, or the whole slice (a
        layout not parsed here) to ``torch.load``. A small slice is read whole
        in one request; a large one's head and tail at once, then its tensor
        bytes go straight to the destination."""
        if getattr(info, "transform_descriptors", None):
            raise InvalidArgumentError(f"tierfs {f.path}: {req.storage_index.fqn} was saved through stream "
                                       f"transforms {info.transform_descriptors}, which this reader does not apply")
        small = info.length <= SMALL_SLICE
        tail_start = 0 if small else max(0, info.length - TAIL_WINDOW)
        if small:
            head = tail = await f.small_bytes(info.offset, info.length)
        else:
            head, tail = await asyncio.gather(f.read_bytes(info.offset, min(HEAD_WINDOW, info.length)),
                                              f.read_bytes(info.offset + tail_start, info.length - tail_start))
        if not head.startswith(b"PK\x03\x04"):
            return await self._locate_safetensors(f, info, req, bytes(head[:HEAD_WINDOW]))
        try:
            entries = _zip_entries(tail, tail_start)
            pkl = [(n, e) for n, e in entries.items() if n.endswith("/data.pkl")]
            if len(pkl) != 1:
                raise _Unrecognized("no data.pkl")
            prefix = pkl[0][0][: -len("data.pkl")]

            async def record(name: str) -> tuple[int, int]:
                """Slice offset of record ``name``'s bytes, and their size."""
                lho, size = entries[name]
                local = head[lho:lho + 30] if lho + 30 <= len(head) else await f.read_bytes(info.offset + lho, 30)
                if local[:4] != b"PK\x03\x04":
                    raise _Unrecognized(f"bad local header of {name}")
                nl, el = struct.unpack_from("<HH", local, 26)
                return lho + 30 + nl + el, size

            p_off, p_size = await record(pkl[0][0])
            raw = head[p_off:p_off + p_size] if p_off + p_size <= len(head) else \
                await f.read_bytes(info.offset + p_off, p_size)
            ref = _Unpickler(io.BytesIO(raw)).load()
            if not isinstance(ref, _TensorRef) or not isinstance(ref.pid, tuple) or len(ref.pid) != 5 \
                    or not isinstance(ref.pid[1], _StorageRef):
                raise _Unrecognized("not a plain tensor")
            _, sref, key, _, numel = ref.pid
            d_off, d_size = await record(f"{prefix}data/{key}")
            if d_size != numel * torch._utils._element_size(sref.dtype):
                raise _Unrecognized("storage size mismatch")
            return _Stored(info.offset + d_off, int(numel), sref.dtype, ref.size, ref.stride, int(ref.storage_offset),
                           raw=head if small else None, base=info.offset)
        except (_Unrecognized, struct.error, pickle.UnpicklingError, KeyError, ValueError, IndexError,
                EOFError, TypeError):
            return head if small else await f.read_bytes(info.offset, info.length)

    async def _st_header(self, f: _Snapshot, info: Any, head: bytes) -> Any:
        size = await f.size()
        if len(head) < 8:
            head = bytes(await f.read_bytes(info.offset, min(8, size - info.offset)))
        if len(head) < 8:
            raise InvalidArgumentError(f"tierfs {f.path}: at offset {info.offset} is neither a torch.save "
                                       f"record nor a safetensors header (the file ends)")
        (n,) = struct.unpack_from("<Q", head)
        if 8 + n > size - info.offset:
            raise InvalidArgumentError(f"tierfs {f.path}: at offset {info.offset} is neither a torch.save "
                                       f"record nor a safetensors header")
        raw = head[8:8 + n] if 8 + n <= len(head) else bytes(await f.read_bytes(info.offset + 8, n))
        return parse_header(f.path, raw, size - info.offset)

    async def _locate_safetensors(self, f: _Snapshot, info: Any, req: ReadItem, head: bytes) -> _Stored:
        """FileSystemWriter's SAFETENSORS format: the rank file's tensors are
        one safetensors blob starting at the slice's offset (its
        ``_StorageInfo`` offsets all point there)."""
        key = (f.path, info.offset)
        if key not in self._st_headers:
            self._st_headers[key] = asyncio.ensure_future(self._st_header(f, info, head))
        header = await self._st_headers[key]
        fqn = req.storage_index.fqn
        t = header.tensors.get(fqn)
        if t is None:
            raise InvalidArgumentError(f"tierfs {f.path}: the safetensors data has no tensor {fqn!r}")
        dtype = self.metadata.state_dict_metadata[fqn].properties.dtype
        itemsize = torch._utils._element_size(dtype)
        numel = (t.end - t.begin) // itemsize
        if numel != math.prod(t.shape):
            raise InvalidArgumentError(f"tierfs {f.path}: tensor {fqn!r} is {t.dtype} in the file but "
                                       f"{dtype} in the checkpoint's metadata")
        return _Stored(info.offset + t.begin, numel, dtype, tuple(t.shape),
                       _contiguous_strides(tuple(t.shape)), 0)

    async def _read_tensor(self, f: _Snapshot, info: Any, req: ReadItem, target: Any,
                           st: _Stored | bytearray) -> None:
        offsets, lengths = tuple(req.storage_offsets), tuple(req.lengths)
        if tuple(target.shape) != lengths:
            raise InvalidArgumentError(f"tierfs {self.path}: {req.storage_index.fqn}: the destination has shape "
                                       f"{tuple(target.shape)} but the read is {lengths}")
        if isinstance(st, bytearray):
            t = torch.load(io.BytesIO(st), map_location="cpu", weights_only=True)
            for d, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
                t = t.narrow(d, o, n)
            target.copy_(t)
            self.stats.loaded += 1
            return
        itemsize = torch._utils._element_size(st.dtype)
        if st.raw is not None:
            if st.storage_numel and math.prod(lengths):
                t = torch.frombuffer(st.raw, dtype=st.dtype, count=st.storage_numel, offset=st.data_offset - st.base)
                t = t.as_strided(st.size, st.stride, st.storage_offset)
                for d, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
                    t = t.narrow(d, o, n)
                target.copy_(t)
            self.stats.small += 1
            return
        run = _region(st, offsets, lengths)
        if (run is not None and target.dtype == st.dtype and target.device.type == "cpu"
                and target.is_contiguous()):
            first, count = run
            if count:
                await f.read(st.data_offset + first * itemsize, byte_view(target, writable=True,
                                                                          what=req.storage_index.fqn))
            self.stats.direct += 1
            return
        scratch = torch.empty(st.storage_numel, dtype=st.dtype)
        if st.storage_numel:
            await f.read(st.data_offset, byte_view(scratch, writable=True, what=req.storage_index.fqn))
        t = scratch.as_strided(st.size, st.stride, st.storage_offset)
        for d, (o, n) in enumerate(zip(offsets, lengths, strict=True)):
            t = t.narrow(d, o, n)
        target.copy_(t)
        self.stats.copied += 1

    def close(self) -> None:
        """Close the client if this reader made it."""
        if self._owns:
            self.client.close()

    def __enter__(self) -> TierFSStorageReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

