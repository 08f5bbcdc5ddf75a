"""Shared fixtures for the storage tests: buffer pool, backend kinds, engines."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tierfs.buffers import BufferPool
from tierfs.storage.io import IOBackend, PosixBackend, UringBackend, probe_uring

_URING_REASON = probe_uring()
BACKEND_KINDS = [
    "posix",
    pytest.param("uring", marks=pytest.mark.skipif(_URING_REASON is not None, reason=str(_URING_REASON))),
]

BackendFactory = Callable[..., IOBackend]


@pytest.fixture
def pool() -> Iterator[BufferPool]:
    p = BufferPool(256 << 20)
    yield p
    p.close()


@pytest.fixture(params=BACKEND_KINDS)
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_backend(backend_kind: str, pool: BufferPool) -> BackendFactory:
    """Builds a backend of the parametrized kind; call it inside the test's
    event loop (io_uring binds to the loop that first uses it)."""

    def make(queue_depth: int = 16) -> IOBackend:
        if backend_kind == "uring":
            return UringBackend(pool, queue_depth=queue_depth)
        return PosixBackend(pool, threads=queue_depth)

    return make
