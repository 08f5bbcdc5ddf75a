"""LMCache remote storage plugin: :class:`TierFSConnector`, an LMCache 0.5.6
``RemoteConnector`` over a TierFS KV pool.

LMCache loads it from its own config (docs/engines.md, "LMCache")::

    remote_storage_plugins: ["tierfs"]
    extra_config:
      remote_storage_plugin.tierfs.module_path: tierfs.integrations.lmcache
      remote_storage_plugin.tierfs.class_name: TierFSConnector
      remote_storage_plugin.tierfs.meta: "10.0.0.1:7100,10.0.0.2:7100"   # else TIERFS_META
      remote_storage_plugin.tierfs.pool: kv                               # else TIERFS_KV_POOL, "default"
      remote_storage_plugin.tierfs.transport: shm      # optional: tcp (default), shm (same host), rdma, auto
      remote_storage_plugin.tierfs.connect_timeout: 10 # optional: seconds start-up waits for the cluster

Each LMCache chunk is one immutable TierFS object holding the chunk's KV bytes
exactly as LMCache's CPU ``MemoryObj`` holds them. The object key is the
chunk's ``CacheEngineKey`` string (model, world size, worker id, chunk hash,
dtype) followed by the full-chunk layout (memory format and shapes), so two
layouts never share an object. Gets allocate the ``MemoryObj`` from LMCache's
local CPU backend, as LMCache's own connectors do, and land the bytes straight
in it; the object's size gives the number of tokens (a partial last chunk),
and a size that fits no whole number of tokens of this layout is a miss,
never wrong bytes.

LMCache calls the connector on its storage manager's event loop. The TierFS
client runs its own loop thread; the async methods hand blocking client calls
to a small thread pool, so LMCache's loop never waits on TierFS I/O. Every
TierFS failure (a dead daemon, a timeout) is a miss for reads and lookups; a
failed put raises, and LMCache counts and logs it (RemoteBackend
``put_failed_count``). Bad configuration raises :class:`~tierfs.errors.ConfigError`
naming the setting when LMCache creates the connector, within
``remote_storage_plugin.tierfs.connect_timeout`` seconds (default
:data:`~tierfs.integrations.common.CONNECT_TIMEOUT`).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from tierfs.errors import ConfigError, TierFSError
from tierfs.integrations.common import CONNECT_TIMEOUT, connect, resolve

__all__ = ["META_KEY", "POOL_KEY", "TIMEOUT_KEY", "TRANSPORT_KEY", "TierFSConnector", "object_key"]

log = logging.getLogger(__name__)

T = TypeVar("T")

META_KEY = "remote_storage_plugin.tierfs.meta"
POOL_KEY = "remote_storage_plugin.tierfs.pool"
TIMEOUT_KEY = "remote_storage_plugin.tierfs.connect_timeout"
TRANSPORT_KEY = "remote_storage_plugin.tierfs.transport"
_TRANSPORTS = ("tcp", "shm", "rdma", "auto")
WHERE = "LMCache extra_config"
_PREFIX = "remote_storage_plugin.tierfs."
#: The keys under ``_PREFIX``: LMCache's loader reads the first two, the
#: connector the rest (``token``: :func:`tierfs.integrations.common.resolve`).
SETTINGS = ("module_path", "class_name", "meta", "pool", "token", "transport", "connect_timeout")

#: TierFS keys are at most 512 bytes; longer ones (a very long model name) are hashed.
_MAX_KEY = 400
#: How many stored keys :meth:`TierFSConnector.list` remembers.
_LIST_LIMIT = 65536
#: Errors that are a miss (reads) or a failed put, never a crash of the engine.
_IO_ERRORS = (TierFSError, OSError, TimeoutError, RuntimeError, ValueError)


def _connect_timeout(extra: Any) -> float:
    raw = (extra or {}).get(TIMEOUT_KEY, CONNECT_TIMEOUT)
    try:
        timeout = float(raw)
    except (TypeError, ValueError):
        timeout = -1.0
    if not (timeout > 0 and math.isfinite(timeout)):  # infinity was taken until stop 48: a wait for ever
        raise ConfigError(f"must be a finite number of seconds > 0, not {raw!r}", field=f"{WHERE} {TIMEOUT_KEY!r}")
    return timeout


def _check_settings(extra: Any) -> None:
    """Keys under ``remote_storage_plugin.tierfs.`` are this connector's
    alone: one it does not know (a misspelt ``conect_timeout``) fails
    start-up, naming it, rather than pass unnoticed."""
    unknown = sorted(str(k) for k in (extra or {}) if str(k).startswith(_PREFIX)
                     and str(k)[len(_PREFIX):] not in SETTINGS)
    if unknown:
        raise ConfigError(f"unknown setting(s) {', '.join(map(repr, unknown))} (known: "
                          f"{', '.join(_PREFIX + k for k in SETTINGS)})", field=f"{WHERE} {unknown[0]!r}")


def _client_options(extra: Any) -> dict[str, Any]:
    transport = (extra or {}).get(TRANSPORT_KEY)
    if transport is None:
        return {}  # the client's own default (ClientConfig / TIERFS_TRANSPORT)
    if transport not in _TRANSPORTS:
        raise ConfigError(f"must be one of {', '.join(_TRANSPORTS)}, not {transport!r}",
                          field=f"{WHERE} {TRANSPORT_KEY!r}")
    return {"transport": transport}


def layout_tag(shapes: Sequence[Any], dtypes: Sequence[Any], fmt: Any) -> str:
    """The full-chunk layout as it appears in object keys, e.g.
    ``KV_2LTD:2x32x256x1024:bfloat16``."""
    groups = [
        "x".join(str(int(d)) for d in shape) + ":" + str(dtype).removeprefix("torch.")
        for shape, dtype in zip(shapes, dtypes, strict=True)
    ]
    return f"{getattr(fmt, 'name', fmt)}:" + ";".join(groups)


def object_key(key: Any, layout: str) -> str:
    """The TierFS object key of an LMCache ``CacheEngineKey`` under ``layout``."""
    s = f"{key.to_string()}|{layout}"
    if len(s.encode()) > _MAX_KEY:
        s = "lmcache-sha256:" + hashlib.sha256(s.encode()).hexdigest()
    return s


class TierFSConnector(RemoteConnector):  # type: ignore[misc]  # LMCache has no type stubs
    """An LMCache remote connector whose store is a TierFS KV pool."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any) -> None:
        metadata = getattr(local_cpu_backend, "metadata", None)
        if metadata is None:
            # LMCache wraps a missing CPU backend (the scheduler role) in a stub
            # without metadata; gets need the real one to allocate into.
            raise ConfigError("the TierFS connector needs LMCache's local CPU backend "
                              "(max_local_cpu_size > 0, worker role)", field="max_local_cpu_size")
        cfg = config if config is not None else local_cpu_backend.config
        if getattr(cfg, "use_layerwise", False):
            # Layerwise objects are one layer of a chunk; the size-derived
            # layout below would read them as a chunk of fewer tokens.
            raise ConfigError("layerwise objects are not supported by the TierFS connector",
                              field="use_layerwise")
        serde = getattr(cfg, "remote_serde", "naive")
        if serde not in (None, "naive"):
            # Compressed objects (cachegen, kivi) have data-dependent sizes and
            # shapes, which this connector does not store.
            raise ConfigError(f"the TierFS connector stores raw KV; {serde!r} is not supported "
                              "(use 'naive')", field="remote_serde")
        super().__init__(local_cpu_backend.config, metadata)
        _check_settings(cfg.extra_config)
        target = resolve(cfg.extra_config, meta_key=META_KEY, pool_key=POOL_KEY, where=WHERE)
        self._client = connect(target, timeout=_connect_timeout(cfg.extra_config),
                               **_client_options(cfg.extra_config))
        self.target = target
        self.kv = self._client.kv_pool(target.pool)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.layout = layout_tag(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
        self._groups = len(self.meta_shapes)
        # Blocking client calls run here, not on LMCache's event loop.
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tierfs-lmcache")
        self._stored: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._stored_lock = threading.Lock()
        self._closed = False
        log.info("TierFS LMCache connector: cluster %s (%s), pool %r (%s), layout %s",
                 ",".join(target.meta), target.meta_setting, target.pool, target.pool_setting, self.layout)

    # ---- helpers ----------------------------------------------------------------

    def _key(self, key: Any) -> str:
        return object_key(key, self.layout)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _allocate(self) -> Any:
        # busy_loop=False: this runs on the connector's threads, which the puts
        # whose completion frees CPU memory need too; spinning here could wait
        # on itself. A full buffer makes the rest of the batch misses instead.
        return self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt,
                                               busy_loop=False)

    def _finish(self, key: Any, memory_obj: Any, n: int | None) -> Any:
        """The loaded MemoryObj for ``n`` bytes read, or None (released) on a miss."""
        if n is None:
            memory_obj.ref_count_down()
            return None
        if n != self.full_chunk_size_bytes:
            if self._groups > 1:
                log.warning("TierFS object for %s has %d bytes, not a full %d-byte chunk of %d layer groups: "
                            "a miss", key, n, self.full_chunk_size_bytes, self._groups)
                memory_obj.ref_count_down()
                return None
            try:
                # LMCache's own rule for partial chunks: whole tokens of this layout only.
                return self.reshape_partial_chunk(memory_obj, n)
            except ValueError as e:
                log.warning("TierFS object for %s does not fit layout %s: %s; a miss", key, self.layout, e)
                memory_obj.ref_count_down()
                return None
        return memory_obj

    def _remember(self, keys: Sequence[str]) -> None:
        with self._stored_lock:
            for k in keys:
                self._stored[k] = None
                self._stored.move_to_end(k)
            while len(self._stored) > _LIST_LIMIT:
                self._stored.popitem(last=False)

    # ---- lookups ----------------------------------------------------------------

    def _contains(self, keys: Sequence[Any]) -> int:
        if not keys:
            return 0
        try:
            return self.kv.batch_exists([self._key(k) for k in keys])
        except _IO_ERRORS as e:
            log.warning("TierFS lookup of %d keys failed (%s): a miss", len(keys), e)
            return 0

    async def exists(self, key: Any) -> bool:
        return await self._call(self._contains, [key]) == 1

    def exists_sync(self, key: Any) -> bool:
        return self._contains([key]) == 1

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """How many leading keys are stored: one KV_EXISTS request per target."""
        return self._contains(keys)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
        return await self._call(self._contains, keys)

    # ---- gets -------------------------------------------------------------------

    def _get_many(self, keys: Sequence[Any]) -> list[Any]:
        objs: list[Any] = []
        for _ in keys:
            obj = self._allocate()
            if obj is None:
                # Out of CPU memory: the rest are misses, as in LMCache's own connectors.
                log.warning("LMCache CPU memory full: %d of %d TierFS gets are misses",
                            len(keys) - len(objs), len(keys))
                break
            objs.append(obj)
        if not objs:
            return [None] * len(keys)
        try:
            sizes = self.kv.batch_get_into([self._key(k) for k in keys[:len(objs)]],
                                           [o.byte_array for o in objs], misfit="miss")
        except _IO_ERRORS as e:
            log.warning("TierFS get of %d keys failed (%s): misses", len(objs), e)
            sizes = [None] * len(objs)
        out = [self._finish(k, o, n) for k, o, n in zip(keys, objs, sizes, strict=False)]
        return out + [None] * (len(keys) - len(out))

    async def get(self, key: Any) -> Any:
        return (await self._call(self._get_many, [key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        return await self._call(self._get_many, keys)

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        """The loaded prefix: objects up to the first miss (the rest released)."""
        got = await self._call(self._get_many, keys)
        out: list[Any] = []
        for i, obj in enumerate(got):
            if obj is None:
                for rest in got[i + 1:]:
                    if rest is not None:
                        rest.ref_count_down()
                break
            out.append(obj)
        return out

    # ---- puts -------------------------------------------------------------------

    def _put_many(self, keys: Sequence[Any], memory_objs: Sequence[Any]) -> None:
        # LMCache's wrapper (InstrumentedRemoteConnector) drops the references
        # once this returns or raises; the bytes are sent by then.
        ks = [self._key(k) for k in keys]
        self.kv.batch_put(ks, [o.byte_array for o in memory_objs])
        self._remember(ks)

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self._call(self._put_many, [key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        if keys:
            await self._call(self._put_many, keys, memory_objs)

    # ---- the rest ---------------------------------------------------------------

    def remove_sync(self, key: Any) -> bool:
        try:
            return self.kv.delete(self._key(key))
        except _IO_ERRORS as e:
            log.warning("TierFS delete of %s failed: %s", key, e)
            return False

    async def list(self) -> list[str]:
        """The keys (LMCache key strings) this connector stored in this
        process, newest last: a TierFS pool has no key listing, and LMCache
        0.5.6 calls list() only from its file-system chunk loader."""
        with self._stored_lock:
            return [k.rsplit("|", 1)[0] for k in self._stored if not k.startswith("lmcache-sha256:")]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Off LMCache's loop: in-flight calls finish (each within kv_timeout) first.
        await asyncio.get_running_loop().run_in_executor(None, self._shutdown)
        log.info("TierFS LMCache connector closed")

    def _shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self._client.close()

    def __repr__(self) -> str:
        return f"<TierFSConnector pool={self.target.pool!r} meta={','.join(self.target.meta)}>"
