"""Keys and buffers of the KV API: what callers may pass, checked once here.

Keys are ``str`` (UTF-8) or ``bytes``, 1..:data:`MAX_KEY_BYTES` bytes.
Buffers are anything with the buffer protocol (``bytes``, ``bytearray``,
``memoryview``, numpy arrays, ``mmap``) and torch tensors: a contiguous CPU
tensor is viewed as its bytes (any dtype, bfloat16 included; one that
requires grad through its detached alias); a CUDA tensor is refused here
and handled by the GPU path (:mod:`tierfs.kv.gpu`).
"""

from __future__ import annotations

import sys
from typing import Any

from tierfs.errors import InvalidArgumentError
from tierfs.net.protocol import MAX_KV_KEY

__all__ = ["MAX_KEY_BYTES", "byte_view", "is_cuda_tensor", "itemsize_of", "normalize_key", "normalize_keys"]

#: Longest key, in bytes (the data plane's limit).
MAX_KEY_BYTES = MAX_KV_KEY


def normalize_key(key: str | bytes | bytearray | memoryview) -> bytes:
    """The key as ``bytes``; InvalidArgumentError if empty, too long or not a key type."""
    if type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES:
        return key  # the common case, first
    if isinstance(key, str):
        try:
            b = key.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate (a file name's undecodable byte, say)
            raise InvalidArgumentError(f"KV key {key!r} is not valid Unicode ({exc.reason}): give such a "
                                       f"key as bytes") from None
    elif isinstance(key, (bytes, bytearray, memoryview)):
        b = bytes(key)
    else:
        raise InvalidArgumentError(f"a KV key is str or bytes, not {type(key).__name__}")
    if not b:
        raise InvalidArgumentError("empty KV key")
    if len(b) > MAX_KEY_BYTES:
        raise InvalidArgumentError(f"KV key of {len(b)} bytes exceeds the limit of {MAX_KEY_BYTES}")
    return b


def normalize_keys(keys: Any) -> list[bytes]:
    """Each key of a batch as ``bytes`` (normalize_key). A single str or
    bytes is refused: iterated, it would be taken as one key per character
    (``batch_put("ab", ...)`` stored keys "a" and "b")."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"a batch takes a sequence of keys, not one {type(keys).__name__} "
                                   f"(wrap a single key in a list)")
    return [normalize_key(k) for k in keys]


def _is_tensor(obj: Any) -> bool:
    # No import: whoever holds a tensor has imported torch already, and a
    # process without torch pays one dict lookup.
    torch = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)
    return tensor is not None and isinstance(obj, tensor)


def is_cuda_tensor(obj: Any) -> bool:
    return _is_tensor(obj) and bool(obj.is_cuda)


def _tensor_bytes(t: Any, *, writable: bool, what: str) -> memoryview:
    """The bytes of a host tensor, through its numpy alias (no copy).
    Untested here: there is no torch in this environment."""
    import torch  # type: ignore[import-not-found,unused-ignore]

    if t.device.type != "cpu":
        if t.is_cuda:
            raise InvalidArgumentError(f"{what} is a CUDA tensor: it goes through the GPU path, not a byte view")
        raise InvalidArgumentError(f"{what} is a tensor on {t.device}, not in host memory")
    # Layout first: is_contiguous() itself fails on a sparse tensor.
    if t.layout != torch.strided:
        raise InvalidArgumentError(f"{what} is a tensor of layout {t.layout}, not strided")
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{what} is a tensor of shape {tuple(t.shape)} that is not contiguous "
                                   f"(call .contiguous())")
    # .numpy() refuses a tensor that requires grad (detach: same memory) and
    # one with a lazy conjugate or negative bit (its memory is not its value).
    t = t.detach()
    if t.is_conj() or t.is_neg():
        if writable:
            raise InvalidArgumentError(f"{what} is a lazily conjugated or negated tensor view "
                                       f"(call .resolve_conj() / .resolve_neg())")
        t = t.resolve_conj().resolve_neg()
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        # any dtype as bytes, those numpy lacks too (bfloat16, float8)
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def byte_view(obj: Any, *, writable: bool, what: str = "buffer") -> memoryview:
    """A flat, C-contiguous ``memoryview`` of the bytes of ``obj``; a clear
    InvalidArgumentError for read-only (when ``writable``), non-contiguous
    or non-buffer objects."""
    try:
        view = obj if isinstance(obj, memoryview) else memoryview(obj)
    except TypeError:
        # A torch tensor has no buffer protocol of its own.
        if not _is_tensor(obj):
            raise InvalidArgumentError(
                f"{what} of type {type(obj).__name__} does not support the buffer protocol") from None
        view = _tensor_bytes(obj, writable=writable, what=what)
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
