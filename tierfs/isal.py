"""Reed-Solomon rebuilds in place, with ISA-L called directly.

The client's codec (:mod:`tierfs.client.codec`) goes through pyeclib, whose
``reconstruct`` wants each source fragment as one ``bytes`` object behind an
80-byte header: every rebuilt MiB of ec:4+2 then costs 4 MiB joined into
fresh memory, pyeclib's own aligned copies and a fresh output, and fresh
memory is slow to touch (page faults). The rebuild worker instead calls the
same library pyeclib's ``isa_l_rs_cauchy`` backend is built on (ISA-L,
shipped with pyeclib) on the caller's buffers: the K sources are read where
they lie (pooled buffers the data plane filled) and only the missing
fragments are computed, straight into buffers the caller hands in (pooled
too).

The code is the same one: the generator matrix is ISA-L's
``gf_gen_cauchy1_matrix(K+M, K)``, the matrix liberasurecode's
``isa_l_rs_cauchy`` encodes with, so every fragment is the one pyeclib
would produce (tests compare them byte for byte). A missing fragment ``j``
is row ``j`` of that matrix times the inverse of the sources' rows, applied
to the sources (one ``ec_encode_data`` call for all missing fragments).

:func:`available` is False when the library cannot be loaded (the callers
fall back to pyeclib).
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from tierfs.buffers import buffer_address

__all__ = ["available", "rebuild_into"]

_lib: Any = None
_tried = False
_lock = threading.Lock()
_enc: dict[tuple[int, int], Any] = {}
_tables: OrderedDict[tuple[int, int, tuple[int, ...], tuple[int, ...]], Any] = OrderedDict()
_MAX_TABLES = 256


def _load() -> Any:
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        paths: list[str] = []
        spec = importlib.util.find_spec("pyeclib")
        if spec is not None and spec.origin:
            libs = os.path.join(os.path.dirname(os.path.dirname(spec.origin)), "pyeclib.libs")
            paths += sorted(glob.glob(os.path.join(libs, "libisal*.so*")))
        paths += ["libisal.so.2", "libisal.so"]
        for p in paths:
            try:
                lib = ctypes.CDLL(p)
                ub, vp, i = ctypes.c_ubyte, ctypes.c_void_p, ctypes.c_int
                lib.gf_gen_cauchy1_matrix.argtypes = [vp, i, i]
                lib.gf_gen_cauchy1_matrix.restype = None
                lib.gf_invert_matrix.argtypes = [vp, vp, i]
                lib.gf_invert_matrix.restype = i
                lib.gf_mul.argtypes = [ub, ub]
                lib.gf_mul.restype = ub
                lib.ec_init_tables.argtypes = [i, i, vp, vp]
                lib.ec_init_tables.restype = None
                lib.ec_encode_data.argtypes = [i, i, i, vp, vp, vp]
                lib.ec_encode_data.restype = None
            except (OSError, AttributeError):
                continue
            _lib = lib
            break
        return _lib


def available() -> bool:
    """Whether ISA-L could be loaded."""
    return _load() is not None


def _encode_matrix(lib: Any, k: int, m: int) -> Any:
    mat = _enc.get((k, m))
    if mat is None:
        mat = (ctypes.c_ubyte * ((k + m) * k))()
        lib.gf_gen_cauchy1_matrix(mat, k + m, k)
        _enc[(k, m)] = mat
    return mat


def _decode_tables(lib: Any, k: int, m: int, src: tuple[int, ...], missing: tuple[int, ...]) -> Any:
    key = (k, m, src, missing)
    with _lock:
        got = _tables.get(key)
        if got is not None:
            _tables.move_to_end(key)
            return got
        enc = _encode_matrix(lib, k, m)
        sub = (ctypes.c_ubyte * (k * k))()
        for r, s in enumerate(src):
            for t in range(k):
                sub[r * k + t] = enc[s * k + t]
        inv = (ctypes.c_ubyte * (k * k))()
        if lib.gf_invert_matrix(sub, inv, k) != 0:
            raise ValueError(f"fragments {list(src)} do not determine the chunk")
        rows = (ctypes.c_ubyte * (len(missing) * k))()
        for r, j in enumerate(missing):
            if j < k:  # a data row of the (systematic) matrix is a unit row
                for t in range(k):
                    rows[r * k + t] = inv[j * k + t]
                continue
            for t in range(k):
                acc = 0
                for i in range(k):
                    acc ^= lib.gf_mul(enc[j * k + i], inv[i * k + t])
                rows[r * k + t] = acc
        tbls = (ctypes.c_ubyte * (32 * k * len(missing)))()
        lib.ec_init_tables(k, len(missing), rows, tbls)
        _tables[key] = tbls
        while len(_tables) > _MAX_TABLES:
            _tables.popitem(last=False)
        return tbls


def rebuild_into(k: int, m: int, srcs: Mapping[int, memoryview], outs: Mapping[int, memoryview]) -> None:
    """Fragments ``outs`` (index -> writable buffer) of an ec:K+M chunk
    computed from the K fragments ``srcs`` (index -> buffer). Every buffer
    has the same length, the chunk's parity size: shorter data fragments are
    zero-extended by the caller. Raises ValueError on bad arguments and
    RuntimeError when ISA-L is not available. Releases the GIL while it
    computes (ctypes)."""
    lib = _load()
    if lib is None:
        raise RuntimeError("ISA-L is not available")
    src = tuple(sorted(srcs))
    missing = tuple(sorted(outs))
    if len(src) != k or not missing:
        raise ValueError(f"{len(src)} sources for ec:{k}+{m} (exactly {k} needed), {len(missing)} to rebuild")
    if any(not 0 <= i < k + m for i in src + missing) or set(src) & set(missing):
        raise ValueError(f"bad fragment indices: sources {list(src)}, missing {list(missing)}")
    views = [srcs[i] for i in src] + [outs[j] for j in missing]
    n = views[0].nbytes
    if n == 0 or any(v.nbytes != n for v in views):
        raise ValueError(f"every buffer must have the same nonzero length, got {[v.nbytes for v in views]}")
    if any(outs[j].readonly for j in missing):
        raise ValueError("output buffers must be writable")
    addrs: list[int] = []
    keep: list[Any] = []  # read-only sources are copied (callers pass writable, pooled ones)
    for v in views:
        a = buffer_address(v)
        if a is None:
            c = ctypes.create_string_buffer(bytes(v), n)
            keep.append(c)
            a = ctypes.addressof(c)
        addrs.append(a)
    tbls = _decode_tables(lib, k, m, src, missing)
    data = (ctypes.c_void_p * k)(*addrs[:k])
    coding = (ctypes.c_void_p * len(missing))(*addrs[k:])
    lib.ec_encode_data(n, k, len(missing), tbls, data, coding)
    del keep


def encode_matrix(k: int, m: int) -> Sequence[int]:
    """The (K+M) x K generator matrix, row by row (for tests)."""
    lib = _load()
    if lib is None:
        raise RuntimeError("ISA-L is not available")
    with _lock:
        return list(_encode_matrix(lib, k, m))
