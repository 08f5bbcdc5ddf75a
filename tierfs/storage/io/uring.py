"""The io_uring backend (``liburing`` package), driven from the asyncio loop.

One ring per backend, owned by the event loop thread that first uses it. An
eventfd is registered with the ring and watched with ``loop.add_reader``:
completions are reaped on the loop thread with no thread hop at all.
Submissions are batched: each operation prepares an SQE and the ring is
entered once per loop iteration (``call_soon``), except an operation alone
in the ring (a queue-depth-1 caller: an SSD-tier hit, one small fragment),
which enters at once. At most ``queue_depth`` operations are in the kernel;
the rest wait in a FIFO backlog. A caller awaits its operation's future
itself, not a shield around it (a loop iteration less per operation); a
cancelled caller still waits for the kernel to finish with its buffer
before the cancellation surfaces (``_wait``).

Reads and writes use ``IORING_OP_READV``/``WRITEV`` with an ``Iovec`` over the
caller's memoryview (``prep_read`` only accepts a ``bytearray``, which is not
aligned and so fails with EINVAL on O_DIRECT files). The ``Iovec`` keeps the
buffer exported until the completion has been reaped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import hashlib
import mmap
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import liburing as L
except ImportError as _exc:  # not Linux, or the wheel does not load here
    L = None
    _IMPORT_ERROR = f"liburing unavailable: {_exc}"

from tierfs.buffers import ALIGN, BufferPool
from tierfs.storage.io.base import IOBackend

__all__ = ["UringBackend", "probe_uring"]

_Prep = Callable[[Any], None]


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_PyBuffer_Release = ctypes.pythonapi.PyBuffer_Release
_PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]
_PyBuffer_Release.restype = None


def _calibrate() -> bool:
    """Whether ``Iovec`` leaks a buffer export per memoryview (it does in
    liburing 2026.3.30: the export and a reference are never given back,
    which would pin every buffer forever). Checked once, on a scratch view,
    after the Iovec is gone, so a fixed release turns compensation off."""
    scratch = bytearray(16)
    view = memoryview(scratch)
    before = sys.getrefcount(view)
    iov = L.Iovec([view])
    del iov
    leaked = sys.getrefcount(view) - before
    _unleak(view, leaked)
    view.release()  # raises if the calibration left an export behind
    return leaked > 0


def _iovec(buf: memoryview) -> tuple[Any, int]:
    """An Iovec over ``buf`` plus the number of exports to give back after the
    kernel is done with it (see ``_calibrate``)."""
    if not _LEAKS:
        return L.Iovec([buf]), 0
    before = sys.getrefcount(buf)
    iov = L.Iovec([buf])
    return iov, max(0, sys.getrefcount(buf) - before)


def _unleak(buf: memoryview, leaked: int) -> None:
    """Undo ``leaked`` exports taken by ``Iovec`` (after the kernel is done)."""
    for _ in range(leaked):
        pb = _PyBuffer()
        pb.obj = id(buf)
        _PyBuffer_Release(ctypes.byref(pb))


_LEAKS = _calibrate() if L is not None else False


def probe_uring() -> str | None:
    """None if io_uring works here (ring setup, READV/WRITEV/FSYNC on an
    O_DIRECT file round trip); otherwise the reason it does not.

    The probe runs in a child process first: the ``liburing`` wheel is built
    for CPUs with AVX-512 and dies of SIGILL on one without (seen on an AMD
    EPYC with AVX2 only), which no ``except`` can catch. Only when the child
    came through is the probe repeated here."""
    if L is None:
        return _IMPORT_ERROR
    stamp = _probe_stamp()
    with contextlib.suppress(OSError):
        if stamp is not None:
            # A child already ran on this CPU with this interpreter and this
            # liburing build: if it came through, only the in-process probe
            # is left; if the wheel died of SIGILL, it would again.
            seen = stamp.read_text()
            if seen == _PASSED:
                return _probe_here()
            if seen.startswith("io_uring probe died of SIGILL"):
                return seen
            # Anything else (a torn or foreign file): probe in a child again.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    code = "import sys; from tierfs.storage.io.uring import _probe_here; sys.stdout.write(_probe_here() or '')"
    try:
        child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"io_uring probe process failed: {exc}"
    if child.returncode < 0:
        sig = signal.Signals(-child.returncode).name
        reason = f"io_uring probe died of {sig} (the liburing wheel does not run on this CPU)"
        if child.returncode == -signal.SIGILL:
            _remember(stamp, reason)
        return reason
    if child.returncode != 0:
        return f"io_uring probe process exited {child.returncode}: {child.stderr.decode(errors='replace')[-300:]}"
    if child.stdout:
        return child.stdout.decode(errors="replace")
    _remember(stamp, _PASSED)
    return _probe_here()


#: What a stamp holds when the child probe came through.
_PASSED = "ok"


def _remember(stamp: Path | None, what: str) -> None:
    """Write ``what`` to ``stamp`` atomically; a cache that cannot be written
    only means the next start probes in a child again."""
    if stamp is None:
        return
    with contextlib.suppress(OSError):
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
        tmp.write_text(what)
        os.replace(tmp, stamp)


def _probe_stamp() -> Path | None:
    """Where the verdict of a child probe is remembered (it came through, or
    the wheel died of SIGILL: both depend only on the key below), so that a
    daemon start (and every test cluster's) does not pay for a second
    interpreter (~0.4 s of CPU): a file named
    after what decides whether the wheel runs here (the CPU's flags, the
    kernel, the interpreter, the liburing build), under
    ``$TIERFS_CACHE_DIR`` or ``$XDG_CACHE_HOME/tierfs`` (``~/.cache/tierfs``).
    None (always probe in a child) when that cannot be worked out."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            flags = next((ln for ln in f if ln.startswith(b"flags")), b"")
        lib = os.stat(L.__file__)
        u = os.uname()
        key = hashlib.sha256(b"\0".join([
            flags, u.release.encode(), u.machine.encode(), sys.executable.encode(), sys.version.encode(),
            str(L.__file__).encode(), str(lib.st_size).encode(), str(lib.st_mtime_ns).encode(),
        ])).hexdigest()[:32]
        base = os.environ.get("TIERFS_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tierfs")
    except (OSError, AttributeError, TypeError):
        return None
    return Path(base) / f"uring-probe-{key}"


def _probe_here() -> str | None:
    """The probe itself, in this process (see :func:`probe_uring`)."""
    if L is None:
        return _IMPORT_ERROR
    try:
        ring = L.Ring()
        L.io_uring_queue_init(4, ring)
    except Exception as exc:  # ENOSYS (old kernel), EPERM (seccomp, sysctl)
        return f"io_uring setup failed: {exc}"
    try:
        with tempfile.TemporaryDirectory(prefix="tierfs-uring-probe-") as d:
            path = os.path.join(d, "p")
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError:
                fd = os.open(path, flags, 0o600)
            mm = mmap.mmap(-1, ALIGN)
            view = memoryview(mm)
            try:
                view[:4] = b"tfs!"
                for prep in ("w", "r", "s"):
                    iov, leaked = _iovec(view)
                    sqe = L.io_uring_get_sqe(ring)
                    if prep == "w":
                        L.io_uring_prep_writev(sqe, fd, iov, 0)
                    elif prep == "r":
                        L.io_uring_prep_readv(sqe, fd, iov, 0)
                    else:
                        L.io_uring_prep_fsync(sqe, fd, 0)
                    L.io_uring_submit(ring)
                    cqe = L.Cqe()
                    L.io_uring_wait_cqe(ring, cqe)
                    try:
                        res = cqe[0].res
                    finally:
                        L.io_uring_cqe_seen(ring, cqe[0])
                    del iov
                    _unleak(view, leaked)
                    if prep in "wr" and res != ALIGN:
                        return f"io_uring {prep} returned {res}"
            finally:
                view.release()
                mm.close()
                os.close(fd)
    except Exception as exc:
        return f"io_uring probe failed: {type(exc).__name__}: {exc}"
    finally:
        L.io_uring_queue_exit(ring)
    return None


class UringBackend(IOBackend):
    name = "uring"

    def __init__(self, pool: BufferPool, queue_depth: int = 64) -> None:
        super().__init__(pool)
        if queue_depth < 1:
            raise ValueError("queue_depth must be >= 1")
        if L is None:
            raise OSError(38, _IMPORT_ERROR)  # ENOSYS
        self.queue_depth = queue_depth
        self._ring = L.Ring()
        L.io_uring_queue_init(queue_depth, self._ring)
        self._cqe = L.Cqe()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        L.io_uring_register_eventfd(self._ring, self._efd)
        self._loop: asyncio.AbstractEventLoop | None = None
        # user_data -> (future, objects the kernel still points into)
        self._ops: dict[int, tuple[asyncio.Future[int], object]] = {}
        self._backlog: collections.deque[tuple[_Prep, object, asyncio.Future[int], int]] = collections.deque()
        self._drained: asyncio.Future[None] | None = None  # set once no operation is in the kernel (aclose)
        self._next_id = 1
        self._unsubmitted = 0
        self._flush_pending = False
        self._closed = False

    # -- loop integration ----------------------------------------------

    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            loop.add_reader(self._efd, self._reap)
        elif self._loop is not loop:
            raise RuntimeError("UringBackend is bound to another event loop")
        return loop

    def _submit(self, prep: _Prep, keep: object) -> tuple[int, asyncio.Future[int]]:
        if self._closed:
            raise RuntimeError("backend is closed")
        loop = self._bind()
        fut: asyncio.Future[int] = loop.create_future()
        uid = self._next_id
        self._next_id = (uid + 1) & ((1 << 63) - 1) or 1
        if len(self._ops) < self.queue_depth:
            self._push(prep, keep, fut, uid)
        else:
            self._backlog.append((prep, keep, fut, uid))
        return uid, fut

    def _push(self, prep: _Prep, keep: object, fut: asyncio.Future[int], uid: int) -> None:
        sqe = L.io_uring_get_sqe(self._ring)
        if sqe is None:  # SQ full of prepared-but-unsubmitted entries
            self._enter()
            sqe = L.io_uring_get_sqe(self._ring)
            assert sqe is not None
        prep(sqe)
        L.io_uring_sqe_set_data64(sqe, uid)
        self._ops[uid] = (fut, keep)
        self._unsubmitted += 1
        if len(self._ops) == 1:
            # Alone in the ring: nothing to batch it with, enter now.
            self._enter()
        elif not self._flush_pending:
            self._flush_pending = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    async def _wait(self, uid: int, fut: asyncio.Future[int]) -> int:
        """The result of operation ``uid``. If the caller is cancelled, its
        future is cancelled with it; while the operation is still in the
        kernel (which reads or writes the caller's buffer until it
        completes) a fresh future takes its place and is awaited, and only
        then does the cancellation surface. An operation still in the
        backlog is dropped there (``_reap`` skips cancelled futures)."""
        try:
            return await fut
        except asyncio.CancelledError:
            pass
        while (op := self._ops.get(uid)) is not None:
            assert self._loop is not None
            later: asyncio.Future[int] = self._loop.create_future()
            self._ops[uid] = (later, op[1])
            try:
                await later
            except asyncio.CancelledError:
                continue  # cancelled again: still wait for the kernel
            except OSError:
                pass
            break
        raise asyncio.CancelledError

    def _flush(self) -> None:
        self._flush_pending = False
        if self._unsubmitted and not self._closed_ring:
            self._enter()

    def _enter(self) -> None:
        while self._unsubmitted:
            try:
                n = L.io_uring_submit(self._ring)
            except (BlockingIOError, InterruptedError):
                # the kernel is short of resources: completions will free some
                # and _reap flushes again
                return
            self._unsubmitted -= n or 0
            if not n:
                return

    def _reap(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._efd)
        cqe = self._cqe
        while True:
            try:
                L.io_uring_peek_cqe(self._ring, cqe)
            except BlockingIOError:
                break
            entry = cqe[0]
            uid = entry.user_data
            err: OSError | None = None
            res = 0
            try:
                res = entry.res or 0
            except OSError as exc:  # negative res: the errno of the op
                err = exc
            L.io_uring_cqe_seen(self._ring, entry)
            op = self._ops.pop(uid, None)
            if op is None:
                continue
            fut = op[0]
            if fut.cancelled():
                continue
            if err is not None:
                fut.set_exception(OSError(err.errno, os.strerror(err.errno or 5)))
            else:
                fut.set_result(res)
        if not self._ops and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        while self._backlog and len(self._ops) < self.queue_depth:
            prep, keep, fut, uid = self._backlog.popleft()
            if not fut.cancelled():  # its caller gave up before the kernel saw it
                self._push(prep, keep, fut, uid)
        if self._unsubmitted:
            self._enter()

    # -- primitives --------------------------------------------------------

    async def _pread(self, fd: int, buf: memoryview, offset: int) -> int:
        return await self._rw(L.io_uring_prep_readv, fd, buf, offset)

    async def _pwrite(self, fd: int, buf: memoryview, offset: int) -> int:
        return await self._rw(L.io_uring_prep_writev, fd, buf, offset)

    async def _rw(self, prep: Callable[..., None], fd: int, buf: memoryview, offset: int) -> int:
        iov, leaked = _iovec(buf)
        keep = [iov, buf]
        try:
            uid, fut = self._submit(lambda sqe: prep(sqe, fd, iov, offset), keep)
            return await self._wait(uid, fut)
        finally:
            # only reached once the kernel has completed (or never got) the op
            keep.clear()
            iov = None
            _unleak(buf, leaked)

    async def _fsync(self, fd: int, datasync: bool) -> None:
        flags = L.IORING_FSYNC_DATASYNC if datasync else 0
        uid, fut = self._submit(lambda sqe: L.io_uring_prep_fsync(sqe, fd, flags), None)
        await self._wait(uid, fut)

    # -- shutdown ------------------------------------------------------------

    _closed_ring = False

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _, _, fut, _ in self._backlog:
            if not fut.done():
                fut.set_exception(RuntimeError("backend closed"))
        self._backlog.clear()
        if self._ops and self._loop is not None:
            # Until the kernel is done with every buffer (a cancelled caller's
            # future may be done already while its operation is not).
            self._drained = self._loop.create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._drained), 30)
        if self._loop is not None:
            self._loop.remove_reader(self._efd)
        self._closed_ring = True
        L.io_uring_unregister_eventfd(self._ring)
        L.io_uring_queue_exit(self._ring)
        os.close(self._efd)
