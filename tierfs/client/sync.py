"""``Client``: the blocking face of :class:`AsyncClient`.

All work runs on one background thread with a uvloop event loop, started on
first use; a blocking call submits the coroutine there and waits. After
``fork`` the child's copy of a client starts a fresh thread and loop on its
next call (the parent's threads and connections do not exist in the child;
they are dropped, not closed, since closing would act on the parent's
sockets).
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

import uvloop

from tierfs.client.client import AsyncClient, FileStat
from tierfs.client.config import ClientConfig
from tierfs.client.file import AsyncFile
from tierfs.kv.client import KV
from tierfs.proto.v1 import meta_pb2 as pb

__all__ = ["Client", "File"]

T = TypeVar("T")

_LIVE: weakref.WeakSet[Client] = weakref.WeakSet()


def _before_fork() -> None:
    for c in list(_LIVE):
        c._quiesce_grpc()


def _after_fork_in_child() -> None:
    for c in list(_LIVE):
        c._forget()


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


class Client:
    """Blocking TierFS client; arguments as for :class:`AsyncClient`."""

    def __init__(self, meta: Sequence[str] | str | None = None, *, config: ClientConfig | None = None,
                 **options: Any) -> None:
        self._args = (meta, config, options)
        self._aclient: AsyncClient | None = AsyncClient(meta, config=config, **options)  # validates now
        self.config = self._aclient.config
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        _LIVE.add(self)

    # ---- KV cache ---------------------------------------------------------------

    @property
    def kv(self) -> KV:
        """The KV API on the default pool (blocking)."""
        return KV(self, self.config.kv_pool)

    def kv_pool(self, name: str) -> KV:
        """The KV API on pool ``name`` (blocking)."""
        return KV(self, name)

    # ---- the loop thread --------------------------------------------------------

    def _quiesce_grpc(self) -> None:
        """Before ``fork``: close this client's gRPC channels. gRPC is not
        fork-safe while channels are live (the child hangs in its first
        call); closed, both processes open new ones on their next call."""
        loop, ac = self._loop, self._aclient
        if loop is None or ac is None or threading.current_thread() is self._thread or not loop.is_running():
            return
        fut = asyncio.run_coroutine_threadsafe(ac._drop_meta_channels(), loop)
        try:
            fut.result(timeout=5.0)
        except Exception:  # never fail the caller's fork
            fut.cancel()

    def _forget(self) -> None:
        self._loop = None
        self._thread = None
        self._lock = threading.Lock()
        self._aclient = None

    def _ensure(self) -> tuple[asyncio.AbstractEventLoop, AsyncClient]:
        if self._closed:
            raise ValueError("the client is closed")
        with self._lock:
            if self._loop is None:
                loop = uvloop.new_event_loop()
                t = threading.Thread(target=self._run_loop, args=(loop,), name="tierfs-client", daemon=True)
                t.start()
                self._loop, self._thread = loop, t
            if self._aclient is None:
                meta, config, options = self._args
                self._aclient = AsyncClient(meta, config=config, **options)
            return self._loop, self._aclient

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        loop, _ = self._ensure()
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking TierFS call made from the client's own event loop; use AsyncClient")
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    @property
    def aclient(self) -> AsyncClient:
        """The AsyncClient behind this client (lives on the background loop)."""
        return self._ensure()[1]

    def close(self) -> None:
        if self._closed:
            return
        loop, thread, ac = self._loop, self._thread, self._aclient
        if loop is not None and ac is not None:
            asyncio.run_coroutine_threadsafe(ac.close(), loop).result()
        elif ac is not None:
            ac.pool.close()
        self._closed = True
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
        self._loop = self._thread = self._aclient = None
        _LIVE.discard(self)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ---- API (see AsyncClient) -----------------------------------------------------

    def open(self, path: str, mode: str = "rb") -> File:
        return File(self, self._run(self.aclient.open(path, mode)))

    def stat(self, path: str) -> FileStat:
        return self._run(self.aclient.stat(path))

    def exists(self, path: str) -> bool:
        return self._run(self.aclient.exists(path))

    @overload
    def ls(self, path: str = ..., *, detail: Literal[False] = ...) -> list[str]: ...

    @overload
    def ls(self, path: str = ..., *, detail: Literal[True]) -> list[FileStat]: ...

    @overload
    def ls(self, path: str = ..., *, detail: bool) -> list[Any]: ...

    def ls(self, path: str = "/", *, detail: bool = False) -> list[Any]:
        return self._run(self.aclient.ls(path, detail=detail))

    def mkdir(self, path: str, *, parents: bool = False, exist_ok: bool = False, mode: int = 0o755) -> None:
        self._run(self.aclient.mkdir(path, parents=parents, exist_ok=exist_ok, mode=mode))

    def rm(self, path: str, *, recursive: bool = False, progress: Callable[[int], None] | None = None) -> None:
        self._run(self.aclient.rm(path, recursive=recursive, progress=progress))

    def rename(self, src: str, dst: str) -> None:
        self._run(self.aclient.rename(src, dst))

    def symlink(self, path: str, target: str) -> None:
        self._run(self.aclient.symlink(path, target))

    def readlink(self, path: str) -> str:
        return self._run(self.aclient.readlink(path))

    def resolve(self, path: str, *, last: bool = True) -> str:
        return self._run(self.aclient.resolve(path, last=last))

    def truncate(self, path: str, size: int) -> None:
        self._run(self.aclient.truncate(path, size))

    def chmod(self, path: str, mode: int) -> None:
        self._run(self.aclient.chmod(path, mode))

    def chown(self, path: str, uid: int | None = None, gid: int | None = None) -> None:
        self._run(self.aclient.chown(path, uid, gid))

    def set_layout(self, path: str, *, chunk_size: int = 0, redundancy: str = "",
                   stripe_width: int = 0) -> pb.Layout:
        return self._run(self.aclient.set_layout(path, chunk_size=chunk_size, redundancy=redundancy,
                                                 stripe_width=stripe_width))

    def read_bytes(self, path: str) -> bytes:
        return self._run(self.aclient.read_bytes(path))

    def write_bytes(self, path: str, data: Any) -> int:
        return self._run(self.aclient.write_bytes(path, data))

    def read_into(self, path: str, buffer: Any, offset: int = 0) -> int:
        return self._run(self.aclient.read_into(path, buffer, offset))


class File:
    """Blocking file object over an :class:`AsyncFile`."""

    def __init__(self, client: Client, afile: AsyncFile) -> None:
        self._client = client
        self._f = afile

    @property
    def path(self) -> str:
        return self._f.path

    @property
    def mode(self) -> str:
        return self._f.mode

    @property
    def closed(self) -> bool:
        return self._f.closed

    @property
    def size(self) -> int:
        return self._f.size

    def readable(self) -> bool:
        return self._f.readable()

    def writable(self) -> bool:
        return self._f.writable()

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return self._client._run(self._f.read(size))

    def readinto(self, buffer: Any) -> int:
        return self._client._run(self._f.readinto(buffer))

    def write(self, data: Any) -> int:
        return self._client._run(self._f.write(data))

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._client._run(self._f.flush())

    def close(self) -> None:
        if not self._f.closed:
            self._client._run(self._f.close())

    def abort(self) -> None:
        self._client._run(self._f.abort())

    def __enter__(self) -> File:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if e is not None and self._f.writable():
            self.abort()
        else:
            self.close()

    def __repr__(self) -> str:
        return f"<tierfs File {self.path!r} mode={self.mode!r}>"
