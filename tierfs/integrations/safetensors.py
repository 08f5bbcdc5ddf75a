"""safetensors files on TierFS (docs/training.md): :func:`load_file` reads the
header with one ranged read and every tensor's bytes in parallel straight
into that tensor's memory; :func:`safe_open` is the lazy handle
(``keys``/``metadata``/``get_tensor``/``get_slice``); :func:`save_file`
writes the library's exact format, streaming each tensor's bytes.

The format: an 8-byte little-endian header length N, N bytes of JSON
(``{"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}``, padded with spaces), then the data, offsets
relative to its start. Headers are checked as the library checks them
(offsets contiguous from 0 and covering the data exactly, sizes equal to
the shape times the dtype's size); anything else is an :class:`InvalidArgumentError` naming the
file and the tensor, and no tensor is returned.

torch is imported on first use, so this module imports without it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import operator
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from tierfs.client import AsyncClient, Client
from tierfs.client.client import FileView, _norm
from tierfs.errors import InvalidArgumentError
from tierfs.kv.keys import byte_view

__all__ = ["AsyncSafeOpen", "SafeOpen", "Slice", "aload_file", "asafe_open", "asave_file", "load_file",
           "safe_open", "save_file"]

#: The first read: big enough for the header of any usual checkpoint shard,
#: so one round trip brings it (a longer header costs one more read).
HEADER_WINDOW = 1 << 20
#: The library's own limit on the header's length.
MAX_HEADER = 100_000_000
#: Tensors read at once; each read is itself split across chunks by the client.
READ_CONCURRENCY = 32

# safetensors name -> (torch attribute, bytes per element). Only the ones
# this torch has are usable; the rest are a clear error naming the dtype.
_DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "C64": ("complex64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1), "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
}


def _torch() -> Any:
    import torch  # type: ignore[import-not-found,unused-ignore]

    return torch


def _torch_dtype(name: str, path: str, tensor: str) -> Any:
    torch = _torch()
    entry = _DTYPES.get(name)
    dt = getattr(torch, entry[0], None) if entry else None
    if entry is None or dt is None:
        raise InvalidArgumentError(f"{path}: tensor {tensor!r} has dtype {name!r}, which "
                                   f"{'safetensors does not define' if entry is None else 'this torch lacks'}"
                                   f" (known: {', '.join(sorted(_DTYPES))})")
    return dt


def _dtype_name(dt: Any, what: str) -> str:
    for name, (attr, _) in _DTYPES.items():
        if getattr(_torch(), attr, None) == dt:
            return name
    raise InvalidArgumentError(f"{what} has dtype {dt}, which safetensors cannot store")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in the header; ``begin``/``end`` are absolute
    offsets in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype][1]


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorInfo]  # in file order
    metadata: dict[str, str] | None
    data_start: int


def parse_header(path: str, raw: bytes, file_size: int) -> Header:
    """Check and decode header JSON ``raw`` of a file of ``file_size`` bytes."""
    def bad(msg: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{path}: invalid safetensors header: {msg}")

    data_start = 8 + len(raw)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise bad(f"a JSON {type(doc).__name__}, not an object")
    meta = doc.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise bad("__metadata__ must map strings to strings")
    infos: list[TensorInfo] = []
    for name, entry in doc.items():
        where = f"tensor {name!r}"
        if not isinstance(entry, dict):
            raise bad(f"{where}: entry is a {type(entry).__name__}, not an object")
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str):
            raise bad(f"{where}: missing or non-string dtype ({dtype!r})")
        if dtype not in _DTYPES:
            raise bad(f"{where}: unknown dtype {dtype!r} (known: {', '.join(sorted(_DTYPES))})")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise bad(f"{where}: shape must be a list of non-negative integers, not {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)):
            raise bad(f"{where}: data_offsets must be [begin, end] non-negative integers, not {offs!r}")
        b, end = offs
        if end < b:
            raise bad(f"{where}: data_offsets {offs} end before they begin")
        nbytes = math.prod(shape) * _DTYPES[dtype][1]
        if end - b != nbytes:
            raise bad(f"{where}: data_offsets {offs} span {end - b} bytes but shape {shape} of {dtype} "
                      f"needs {nbytes}")
        infos.append(TensorInfo(name, dtype, tuple(shape), data_start + b, data_start + end))
    infos.sort(key=lambda t: (t.begin, t.end))
    pos = data_start
    for t in infos:
        if t.begin != pos:
            what = "overlaps the previous tensor" if t.begin < pos else "leaves a gap before it"
            raise bad(f"tensor {t.name!r}: data_offsets [{t.begin - data_start}, {t.end - data_start}] "
                      f"{what} (expected to begin at {pos - data_start})")
        pos = t.end
    if pos > file_size:
        last = infos[-1]
        raise bad(f"tensor {last.name!r}: data ends at byte {pos} of the file, past its end ({file_size} bytes; "
                  f"truncated?)")
    if pos != file_size:
        raise bad(f"the tensors' data ends at byte {pos} but the file has {file_size} bytes")
    return Header({t.name: t for t in infos}, meta, data_start)


class _Reader:
    """One file's snapshot (one stat), read at offsets: every read of a load
    sees the same version of the file."""

    def __init__(self, client: AsyncClient, path: str) -> None:
        self.client, self.path = client, path
        self.view: FileView | None = None
        self.header: Header | None = None

    async def read(self, offset: int, dest: memoryview) -> int:
        assert self.view is not None
        n, self.view = await self.client._read_fresh(self.view, offset, dest)
        return n

    async def open(self) -> Header:
        c = self.client
        self.view = view = FileView.of(self.path, await c.meta.stat(_norm(self.path)))
        size = view.size
        if size < 8:
            raise InvalidArgumentError(f"{self.path}: not a safetensors file: {size} bytes, shorter than the "
                                       f"8-byte header length")
        first = bytearray(min(size, HEADER_WINDOW))
        got = await self.read(0, memoryview(first))
        (n,) = struct.unpack_from("<Q", first)
        if n > MAX_HEADER:
            raise InvalidArgumentError(f"{self.path}: invalid safetensors header: length {n} exceeds the "
                                       f"{MAX_HEADER}-byte limit")
        if 8 + n > size:
            raise InvalidArgumentError(f"{self.path}: invalid safetensors header: length {n} runs past the end "
                                       f"of the file ({size} bytes; truncated?)")
        if 8 + n <= got:
            raw = bytes(first[8:8 + n])
        else:
            rest = bytearray(8 + n - got)
            await self.read(got, memoryview(rest))
            raw = bytes(first[8:got]) + bytes(rest)
        self.header = parse_header(self.path, raw, size)
        return self.header

    async def tensor(self, info: TensorInfo, rows: tuple[int, int] | None = None) -> Any:
        """A new CPU tensor holding ``info`` (only rows [r0, r1) of dim 0
        when ``rows`` is given), read straight into its memory."""
        torch = _torch()
        dt = _torch_dtype(info.dtype, self.path, info.name)
        shape, begin, end = info.shape, info.begin, info.end
        if rows is not None:
            r0, r1 = rows
            row = math.prod(shape[1:]) * info.itemsize
            shape, begin, end = (r1 - r0, *shape[1:]), info.begin + r0 * row, info.begin + r1 * row
        t = torch.empty(shape, dtype=dt)
        if end > begin:
            dest = byte_view(t, writable=True, what=f"tensor {info.name!r}")
            n = await self.read(begin, dest)
            if n != end - begin:
                raise InvalidArgumentError(f"{self.path}: tensor {info.name!r}: read {n} of {end - begin} bytes "
                                           f"(the file shrank while loading?)")
        return t


def _async_of(client: Any, fn: str) -> AsyncClient:
    if isinstance(client, AsyncClient):
        return client
    raise InvalidArgumentError(f"{fn} needs a tierfs AsyncClient, not {type(client).__name__}")


def _sync_of(client: Any, fn: str, alt: str) -> Client:
    if isinstance(client, Client):
        return client
    if isinstance(client, AsyncClient):
        raise InvalidArgumentError(f"{fn} is blocking and needs a tierfs Client; with an AsyncClient use "
                                   f"`await {alt}(...)`")
    raise InvalidArgumentError(f"{fn} needs a tierfs Client, not {type(client).__name__}")


def _to(tensors: dict[str, Any], device: Any) -> dict[str, Any]:
    # Tensors are loaded into host memory; another device gets a copy of each.
    if str(device) == "cpu":
        return tensors
    return {k: v.to(device) for k, v in tensors.items()}


async def aload_file(client: AsyncClient, path: str, device: Any = "cpu") -> dict[str, Any]:
    """:func:`load_file` on an :class:`AsyncClient`."""
    r = _Reader(_async_of(client, "aload_file"), path)
    header = await r.open()
    slots = asyncio.Semaphore(READ_CONCURRENCY)

    async def one(info: TensorInfo) -> Any:
        async with slots:
            return await r.tensor(info)

    # Every dtype is checked before any read starts.
    for info in header.tensors.values():
        _torch_dtype(info.dtype, path, info.name)
    # In the order of their bytes in the file, as the library's load_file
    # returns them.
    infos = sorted(header.tensors.values(), key=lambda i: (i.begin, i.name))
    got = await asyncio.gather(*(one(i) for i in infos))
    return _to(dict(zip((i.name for i in infos), got, strict=True)), device)


def load_file(client: Client, path: str, device: Any = "cpu") -> dict[str, Any]:
    """All tensors of safetensors file ``path``, as ``safetensors.torch.load_file``
    returns them: the header by one ranged read (two if it is over 1 MiB),
    then every tensor read in parallel into its own freshly allocated CPU
    tensor. ``device`` other than ``"cpu"``: loaded on the CPU, then
    ``.to(device)``."""
    c = _sync_of(client, "load_file", "aload_file")
    return c._run(aload_file(c.aclient, path, device))


class Slice:
    """A tensor not yet read (``safe_open(...).get_slice(name)``): its
    ``get_shape()``/``get_dtype()``, and ``[a:b]``, ``[i]``, ``[a:b, ...]``
    read only the rows of dim 0 asked for; indices past dim 0 are applied in
    memory to those rows."""

    def __init__(self, owner: SafeOpen | AsyncSafeOpen, info: TensorInfo) -> None:
        self._owner, self.info = owner, info

    def get_shape(self) -> list[int]:
        return list(self.info.shape)

    def get_dtype(self) -> str:
        return self.info.dtype

    def _plan(self, key: Any) -> tuple[tuple[int, int], Any]:
        """(rows of dim 0 to read, the index to apply to them)."""
        info = self.info
        if not info.shape:
            if key == () or key is Ellipsis or (isinstance(key, tuple) and all(k is Ellipsis for k in key)):
                return (0, 0), key  # a scalar: read whole (rows ignored)
            raise InvalidArgumentError(f"tensor {info.name!r} is a scalar; it has no dim 0 to slice")
        keys = key if isinstance(key, tuple) else (key,)
        first, rest = (keys[0], keys[1:]) if keys else (slice(None), ())
        if first is Ellipsis:
            return (0, info.shape[0]), key
        n = info.shape[0]
        if not isinstance(first, (int, slice)) and hasattr(first, "__index__") and not isinstance(first, bool):
            # numpy and torch integer scalars, as the safetensors library
            # takes them (refused until stop 47)
            with contextlib.suppress(TypeError):
                first = operator.index(first)
        if isinstance(first, int) and not isinstance(first, bool):
            i = first + n if first < 0 else first
            if not 0 <= i < n:
                raise IndexError(f"index {first} is out of range for dim 0 of tensor {info.name!r} (size {n})")
            return (i, i + 1), (0, *rest)
        if isinstance(first, slice):
            start, stop, step = first.indices(n)
            if step < 0:
                raise InvalidArgumentError(f"tensor {info.name!r}: negative slice steps are not supported")
            stop = max(start, stop)
            return (start, stop), (slice(None, None, step), *rest)
        raise InvalidArgumentError(f"tensor {info.name!r}: index {first!r} along dim 0 is not supported "
                                   f"(use an int or a slice)")

    async def _aget(self, key: Any) -> Any:
        rows, local = self._plan(key)
        reader = self._owner._reader
        if not self.info.shape:
            t = await reader.tensor(self.info)
        else:
            t = await reader.tensor(self.info, rows)
        t = t[local].contiguous()
        device = self._owner._device
        # The handle's device applies to slices too (as in safetensors): a
        # tensor-parallel loader slicing its shard onto the GPU gets it there.
        return t if str(device) == "cpu" else t.to(device)

    def __getitem__(self, key: Any) -> Any:
        owner = self._owner
        if isinstance(owner, AsyncSafeOpen):
            raise InvalidArgumentError("slices of an asafe_open handle are read with `await s.aget(key)`")
        return owner._client._run(self._aget(key))

    async def aget(self, key: Any) -> Any:
        return await self._aget(key)


class _Handle:
    _reader: _Reader
    _device: Any
    _header: Header | None = None

    def _h(self) -> Header:
        if self._header is None:
            raise ValueError("the safe_open handle is closed or not entered")
        return self._header

    def keys(self) -> list[str]:
        """The tensor names, sorted (as the library's ``keys()``)."""
        return sorted(self._h().tensors)

    def offset_keys(self) -> list[str]:
        """The tensor names in the order of their bytes in the file."""
        return [i.name for i in sorted(self._h().tensors.values(), key=lambda i: (i.begin, i.name))]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def metadata(self) -> dict[str, str] | None:
        m = self._h().metadata
        return None if m is None else dict(m)

    def _info(self, name: str) -> TensorInfo:
        info = self._h().tensors.get(name)
        if info is None:
            raise KeyError(f"{self._reader.path} has no tensor {name!r}")
        return info

    def get_slice(self, name: str) -> Slice:
        assert isinstance(self, (SafeOpen, AsyncSafeOpen))
        return Slice(self, self._info(name))


class SafeOpen(_Handle):
    """``with safe_open(client, path) as f:`` the header is read on entry;
    ``f.get_tensor(name)`` reads one tensor."""

    def __init__(self, client: Client, path: str, device: Any = "cpu") -> None:
        self._client = _sync_of(client, "safe_open", "asafe_open")
        self._device = device
        self._reader = _Reader(self._client.aclient, path)

    def __enter__(self) -> SafeOpen:
        self._header = self._client._run(self._reader.open())
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._header = None

    def get_tensor(self, name: str) -> Any:
        t = self._client._run(self._reader.tensor(self._info(name)))
        return t if str(self._device) == "cpu" else t.to(self._device)


class AsyncSafeOpen(_Handle):
    """``async with asafe_open(aclient, path) as f:``, ``await f.get_tensor(name)``."""

    def __init__(self, client: AsyncClient, path: str, device: Any = "cpu") -> None:
        self._device = device
        self._reader = _Reader(_async_of(client, "asafe_open"), path)

    async def __aenter__(self) -> AsyncSafeOpen:
        self._header = await self._reader.open()
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._header = None

    async def get_tensor(self, name: str) -> Any:
        t = await self._reader.tensor(self._info(name))
        return t if str(self._device) == "cpu" else t.to(self._device)


def safe_open(client: Client, path: str, device: Any = "cpu") -> SafeOpen:
    """The lazy handle (a context manager), like ``safetensors.safe_open``."""
    return SafeOpen(client, path, device)


def asafe_open(client: AsyncClient, path: str, device: Any = "cpu") -> AsyncSafeOpen:
    return AsyncSafeOpen(client, path, device)


# Order of the library's Dtype enum: it lays tensors out by it (largest
# alignment first), then by name.
_ORDER = ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16",
          "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64"]


def _serialize_header(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None) -> tuple[bytes, list[Any]]:
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise InvalidArgumentError("metadata must map strings to strings")
    torch = _torch()
    items = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(f"tensor names must be strings, not {name!r}")
        if name == "__metadata__":
            raise InvalidArgumentError("'__metadata__' is reserved and cannot name a tensor")
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise InvalidArgumentError(f"tensor {name!r} has layout {t.layout}; only dense tensors can be saved")
        dn = _dtype_name(t.dtype, f"tensor {name!r}")
        rank = _ORDER.index(dn) if dn in _ORDER else len(_ORDER)
        items.append((-rank, name, dn, t))
    items.sort(key=lambda x: (x[0], x[1]))
    doc: dict[str, Any] = {}
    if metadata is not None:
        doc["__metadata__"] = dict(metadata)
    pos, order = 0, []
    for _, name, dn, t in items:
        n = t.numel() * t.element_size()
        doc[name] = {"dtype": dn, "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
        order.append(t)
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, order


async def asave_file(tensors: Mapping[str, Any], client: AsyncClient, path: str,
                     metadata: Mapping[str, str] | None = None) -> None:
    """:func:`save_file` on an :class:`AsyncClient`."""
    c = _async_of(client, "asave_file")
    head, order = _serialize_header(tensors, metadata)
    f = await c.open(path, "wb")
    try:
        await f.write(head)
        for t in order:
            if t.numel():
                # One tensor at a time is copied only if it is not already
                # contiguous host memory; the file is never serialized whole.
                src = t.detach()
                if src.device.type != "cpu":
                    src = src.cpu()
                await f.write(byte_view(src.contiguous(), writable=False, what="tensor"))
    except BaseException:
        await f.abort()
        raise
    await f.close()


def save_file(tensors: Mapping[str, Any], client: Client, path: str,
              metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` in the safetensors format, as
    ``safetensors.torch.save_file`` lays it out (same order, same padding),
    each tensor's bytes written from its own memory."""
    c = _sync_of(client, "save_file", "asave_file")
    c._run(asave_file(tensors, c.aclient, path, metadata))
