"""Chunk <-> fragments: Reed-Solomon (pyeclib, ``isa_l_rs_cauchy``) and replicas.

Fragment format (headerless, "format 1"). With ``K`` data fragments and a
chunk size ``C``, fragment ``j < K`` holds bytes ``[j*F, (j+1)*F)`` of the
chunk, ``F = ceil(C / K)``. A chunk whose logical length ``L`` is short (the
tail of a file, a sparse write) is treated as zero-padded to ``K*F``, and
every fragment is stored *trimmed*:

* data fragment ``j`` stores ``clamp(L - j*F, 0, P)`` bytes, ``P = min(F, L)``;
* parity fragments store ``P`` bytes

(:func:`tierfs.chunk.fragment_size` and :func:`tierfs.chunk.parity_size`: the
one rule that encode, decode, rebuild and scrub share).

Reed-Solomon over GF(2^8) combines byte ``p`` of every data fragment into
byte ``p`` of every parity fragment, so parity bytes at ``p >= P`` (where all
data fragments are zero) are zero and need not be stored. Hence:

* the code is systematic and *positional*: chunk byte ``c`` is byte
  ``c % F`` of data fragment ``c // F``, whatever ``L`` is, so a reader maps a
  byte range to ranged fragment reads without knowing ``L``; bytes a
  fragment does not have read as zeros (holes inside a chunk are free);
* a small file costs ``(1 + M) * L`` bytes on disk, not ``(K + M) * F``.

pyeclib's own fragments start with a header (80 bytes for ISA-L) that
describes the encoded length and the fragment index and carries no data
checksum (integrity is the data plane's CRC32C). It is not stored: the
payloads are stored and, to decode, the header pyeclib wants is rebuilt from
a template (the headers of an encoded zero buffer of the same length, which
are byte-identical to those of any other buffer of that length).

Replicas (``replica:N``) store the chunk's first ``L`` bytes on each of the
``N`` targets.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from pyeclib.ec_iface import ECDriver

from tierfs.chunk import fragment_size, parity_size
from tierfs.errors import InvalidArgumentError
from tierfs.proto.v1 import meta_pb2 as pb

__all__ = ["Codec", "codec_for"]

EC_TYPE = "isa_l_rs_cauchy"
_TEMPLATES = 64


class Codec:
    """How the chunks of one layout become fragments (see the module docstring)."""

    def __init__(self, kind: str, k: int, m: int) -> None:
        if kind not in ("ec", "replica"):
            raise InvalidArgumentError(f"unknown redundancy kind {kind!r}")
        if k < 1 or m < 0 or (kind == "replica" and k != 1):
            raise InvalidArgumentError(f"bad redundancy {kind}:{k}+{m}")
        self.kind, self.k, self.m = kind, k, m
        self.width = k + m
        self._driver: Any = ECDriver(k=k, m=m, ec_type=EC_TYPE) if kind == "ec" and m > 0 else None
        self._lock = threading.Lock()
        self._headers: OrderedDict[int, list[bytes]] = OrderedDict()

    @property
    def replicated(self) -> bool:
        return self.kind == "replica"

    def __repr__(self) -> str:
        return f"replica:{self.width}" if self.replicated else f"ec:{self.k}+{self.m}"

    def frag_size(self, chunk_size: int) -> int:
        """F: chunk bytes per data fragment."""
        return chunk_size if self.replicated else -(-chunk_size // self.k)

    def encode_size(self, chunk_size: int) -> int:
        """Bytes of the zero-padded buffer ``encode`` reads (K*F)."""
        return self.frag_size(chunk_size) * (1 if self.replicated else self.k)

    def encode(self, buf: memoryview, length: int, chunk_size: int) -> list[memoryview]:
        """Fragments (trimmed, see the module docstring) of a chunk whose first
        ``length`` bytes are ``buf[:length]``; ``buf`` must hold
        ``encode_size(chunk_size)`` bytes, zero from ``length`` on. The
        returned views do not reference ``buf`` for EC (it may be reused at
        once); for replicas they are ``buf[:length]`` itself."""
        if length <= 0:
            raise InvalidArgumentError("cannot encode an empty chunk")
        if self.replicated:
            return [buf[:length]] * self.width
        f = self.frag_size(chunk_size)
        p = parity_size(self.k, chunk_size, length)
        # p < f: only fragment 0 holds data; the others are p zero bytes.
        data = bytes(buf[: self.k * f]) if p == f else bytes(buf[:p]) + bytes((self.k - 1) * p)
        if self._driver is None:  # ec:K+0
            frags = [data[j * p:(j + 1) * p] for j in range(self.k)]
            hdr = 0
        else:
            frags = self._driver.encode(data)
            hdr = len(frags[0]) - p
            self._remember_headers(p, frags, hdr)
        out: list[memoryview] = []
        for j, fr in enumerate(frags):
            out.append(memoryview(fr)[hdr: hdr + fragment_size(j, self.k, chunk_size, length)])
        return out

    def decode(self, frags: dict[int, memoryview], p: int) -> bytes:
        """The ``K*p``-byte encode buffer from any K fragments (index ->
        stored payload, at most ``p`` bytes each; shorter data fragments are
        zero-extended). Segment ``j`` of the result is chunk bytes
        ``[j*F, j*F + p)``."""
        if len(frags) < self.k:
            raise InvalidArgumentError(f"{self!r} needs {self.k} fragments to decode, got {len(frags)}")
        if all(j in frags for j in range(self.k)) or self._driver is None:
            return b"".join(bytes(frags[j]) + bytes(p - len(frags[j])) for j in range(self.k))
        headers = self._headers_for(p)
        parts: list[bytes] = []
        for j in sorted(frags)[: self.k]:
            payload = frags[j]
            parts.append(b"".join((headers[j], payload, bytes(p - len(payload)))))
        out = self._driver.decode(parts)
        assert isinstance(out, bytes)
        return out

    def reconstruct(self, frags: dict[int, memoryview], p: int, missing: Sequence[int]) -> dict[int, memoryview]:
        """The ``p``-byte payloads of the ``missing`` fragments from any K
        others (index -> stored payload, shorter data fragments
        zero-extended). Much cheaper than :meth:`decode` when few are
        missing (pyeclib's decode rebuilds and joins everything)."""
        if len(frags) < self.k:
            raise InvalidArgumentError(f"{self!r} needs {self.k} fragments to rebuild, got {len(frags)}")
        if not missing:
            return {}
        if self._driver is None:
            raise InvalidArgumentError(f"{self!r} has no parity to rebuild from")
        headers = self._headers_for(p)
        hdr = len(headers[0])
        parts = [b"".join((headers[j], frags[j], bytes(p - len(frags[j])))) for j in sorted(frags)[: self.k]]
        out = self._driver.reconstruct(parts, list(missing))
        return {j: memoryview(fr)[hdr: hdr + p] for j, fr in zip(missing, out, strict=True)}

    def _remember_headers(self, p: int, frags: Sequence[bytes], hdr: int) -> None:
        with self._lock:
            if p in self._headers:
                self._headers.move_to_end(p)
                return
            self._headers[p] = [bytes(memoryview(fr)[:hdr]) for fr in frags]
            while len(self._headers) > _TEMPLATES:
                self._headers.popitem(last=False)

    def _headers_for(self, p: int) -> list[bytes]:
        with self._lock:
            got = self._headers.get(p)
            if got is not None:
                self._headers.move_to_end(p)
                return got
        frags = self._driver.encode(bytes(self.k * p))
        self._remember_headers(p, frags, len(frags[0]) - p)
        return self._headers[p]


_CODECS: dict[tuple[str, int, int], Codec] = {}
_CODECS_LOCK = threading.Lock()


def codec_for(layout: pb.Layout) -> Codec:
    """The (shared, cached) codec of a file layout."""
    if layout.kind == pb.REDUNDANCY_KIND_REPLICA:
        key = ("replica", 1, layout.data_shards + layout.parity_shards - 1)
    elif layout.kind == pb.REDUNDANCY_KIND_EC:
        key = ("ec", layout.data_shards, layout.parity_shards)
    else:
        raise InvalidArgumentError(f"layout has no redundancy kind: {layout}")
    with _CODECS_LOCK:
        c = _CODECS.get(key)
        if c is None:
            c = _CODECS[key] = Codec(*key)
        return c
