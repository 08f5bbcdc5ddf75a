"""Keys and buffers of the KV API: what callers may pass, checked once here.

Keys are ``str`` (UTF-8) or ``bytes``, 1..:data:`MAX_KEY_BYTES` bytes.
Buffers are anything with the buffer protocol (``bytes``, ``bytearray``,
``memoryview``, numpy arrays, ``mmap``) and torch tensors: a contiguous CPU
tensor is viewed as its bytes (any dtype, bfloat16 included); a CUDA tensor
is refused here and handled by the GPU path (:mod:`tierfs.kv.gpu`).
"""

from __future__ import annotations

from typing import Any

from tierfs.errors import InvalidArgumentError
from tierfs.net.protocol import MAX_KV_KEY

__all__ = ["MAX_KEY_BYTES", "byte_view", "is_cuda_tensor", "itemsize_of", "normalize_key"]

#: Longest key, in bytes (the data plane's limit).
MAX_KEY_BYTES = MAX_KV_KEY


def normalize_key(key: str | bytes | bytearray | memoryview) -> bytes:
    """The key as ``bytes``; InvalidArgumentError if empty, too long or not a key type."""
    if isinstance(key, str):
        b = key.encode("utf-8")
    elif isinstance(key, (bytes, bytearray, memoryview)):
        b = bytes(key)
    else:
        raise InvalidArgumentError(f"a KV key is str or bytes, not {type(key).__name__}")
    if not b:
        raise InvalidArgumentError("empty KV key")
    if len(b) > MAX_KEY_BYTES:
        raise InvalidArgumentError(f"KV key of {len(b)} bytes exceeds the limit of {MAX_KEY_BYTES}")
    return b


def is_cuda_tensor(obj: Any) -> bool:
    return bool(getattr(obj, "is_cuda", False)) and type(obj).__module__.startswith("torch")


def _tensor_bytes(t: Any) -> memoryview:
    if is_cuda_tensor(t):
        raise InvalidArgumentError("a CUDA tensor goes through the GPU path, not a byte view")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"tensor of shape {tuple(t.shape)} is not contiguous (call .contiguous())")
    if t.layout.__class__.__name__ != "layout" or str(t.layout) != "torch.strided":
        raise InvalidArgumentError(f"tensor layout {t.layout} is not strided")
    import torch  # type: ignore[import-not-found,unused-ignore]

    flat = t.reshape(-1)
    # .view(uint8) works for every dtype numpy lacks (bfloat16, float8).
    raw = flat.view(torch.uint8) if flat.element_size() else flat
    return memoryview(raw.numpy()).cast("B")


def byte_view(obj: Any, *, writable: bool, what: str = "buffer") -> memoryview:
    """A flat, C-contiguous ``memoryview`` of the bytes of ``obj``; a clear
    InvalidArgumentError for read-only (when ``writable``), non-contiguous
    or non-buffer objects."""
    if type(obj).__module__.startswith("torch") and hasattr(obj, "is_contiguous"):
        view = _tensor_bytes(obj)
    else:
        try:
            view = obj if isinstance(obj, memoryview) else memoryview(obj)
        except TypeError:
            raise InvalidArgumentError(
                f"{what} of type {type(obj).__name__} does not support the buffer protocol") from None
        if not view.c_contiguous:
            raise InvalidArgumentError(f"{what} is not C-contiguous (shape {view.shape}, strides {view.strides})")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
    if writable and view.readonly:
        raise InvalidArgumentError(f"{what} is read-only; get_into needs a writable buffer")
    return view


def itemsize_of(obj: Any) -> int:
    """Bytes per element of a typed buffer (a tensor's or array's dtype), 1 for plain bytes."""
    es = getattr(obj, "element_size", None)
    if callable(es):
        return int(es())
    return int(getattr(obj, "itemsize", 1) or 1)
