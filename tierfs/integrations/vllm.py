"""TierFS as a secondary tier of vLLM's KV offloading (``TieringOffloadingSpec``).

vLLM keeps offloaded KV chunks in a CPU buffer (the *primary* tier, one row
per chunk, shared with the workers through an mmap) and cascades each stored
chunk to its secondary tiers; a chunk found only in a secondary tier is
promoted back into a primary row before the workers copy it to the device.
This tier moves whole primary rows to and from a TierFS KV pool:

- ``submit_store`` puts rows straight from the primary buffer and
  ``submit_load`` gets objects straight into the rows vLLM allocated (views of
  the buffer, no staging copy);
- every method runs on the scheduler's step path, so none of them waits on the
  network: transfers run on the TierFS client's event-loop thread and report
  through a queue that ``get_finished_jobs`` drains; lookups are batched per
  step and answered by a background thread (vLLM's ``AsyncLookupManager``);
- keys name the model, KV dtype and layout, chunk size and parallel layout
  (vLLM's own offload keys are only a block hash and a group index), and a
  manifest object per namespace makes an engine whose chunks do not match the
  stored ones fail at start-up instead of reading wrong bytes.

Configure it in ``kv_transfer_config.kv_connector_extra_config``::

    {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 << 30,
     "secondary_tiers": [{"type": "TierFSSecondaryTier",
                          "module_path": "tierfs.integrations.vllm",
                          "meta": "10.0.0.1:7100,10.0.0.2:7100", "pool": "kv"}]}

``meta`` and ``pool`` fall back to ``TIERFS_META`` / ``TIERFS_KV_POOL`` /
``default``. See docs/engines.md, "vLLM".
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingMetricMetadata,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

from tierfs.client import Client
from tierfs.errors import ConfigError, TierFSError
from tierfs.integrations.common import CONNECT_TIMEOUT, connect, key_component, resolve

__all__ = ["KEY_LAYOUTS", "TierFSSecondaryTier", "layout_of"]

log = logging.getLogger(__name__)

#: Key layouts this version writes and reads. The manifest records the one a
#: namespace was written with, so a later layout cannot misread old objects.
KEY_LAYOUTS = ("v1",)

_WHERE = "vLLM secondary_tiers[TierFSSecondaryTier]"
_SETTINGS = ("meta", "pool", "token", "namespace", "key_layout", "transport", "connect_timeout", "batch_bytes",
             "batches_in_flight", "locality", "known_keys")
_TRANSPORTS = ("tcp", "shm", "rdma", "auto")
#: Seconds between tries of a manifest check the pool could not answer.
MANIFEST_RETRY = 10.0

# Metric names (Prometheus, through vLLM's OffloadPromMetrics), labelled by pool.
LOAD_FAILED_CHUNKS = "vllm:kv_offload_tierfs_load_failed_chunks"
STORE_FAILED_CHUNKS = "vllm:kv_offload_tierfs_store_failed_chunks"
STORE_SKIPPED_CHUNKS = "vllm:kv_offload_tierfs_store_skipped_chunks"
TOUCHED_CHUNKS = "vllm:kv_offload_tierfs_touched_chunks"


def layout_of(spec: Any, block_size_bytes: int, key_layout: str, namespace: str | None) -> dict[str, Any]:
    """What the bytes of one stored chunk mean, from vLLM's normalized
    offloading config: the manifest's content. ``prefix`` is the key prefix."""
    cfg = spec.config
    par = cfg.parallel
    tokens_per_block = sorted({g.tokens_per_block for g in cfg.groups})
    tokens_per_chunk = [t * cfg.cache.blocks_per_chunk for t in tokens_per_block]
    ns = namespace if namespace else cfg.model.name
    layout = {
        "engine": "vllm",
        "key_layout": key_layout,
        "namespace": ns,
        "model": cfg.model.name,
        "dtype": cfg.model.dtype,
        "kv_cache_layout": cfg.kv_cache_layout or "default",
        "tokens_per_hash": cfg.cache.tokens_per_hash,
        "blocks_per_chunk": cfg.cache.blocks_per_chunk,
        "tokens_per_chunk": tokens_per_chunk,
        "chunk_bytes": block_size_bytes,
        "worker_kv_bytes_per_block": cfg.worker_kv_bytes_per_block,
        "groups": [{"tokens_per_block": g.tokens_per_block, "layers": len(g.layer_names),
                    "layer_digest": hashlib.sha256("\0".join(g.layer_names).encode()).hexdigest()[:12]}
                   for g in cfg.groups],
        "tp": par.tp_size, "pp": par.pp_size, "pcp": par.pcp_size, "dcp": par.dcp_size, "rank": par.rank,
        "replicated_layout": bool(cfg.replicated_layout),
        "canonical_layout": bool(cfg.canonical_layout),
    }
    # The readable part names what makes two engines' chunks different;
    # what else must agree is checked against the manifest at start-up.
    tpc = "+".join(str(t) for t in tokens_per_chunk)
    layout["prefix"] = (f"vllm/{key_component(ns)}/{key_component(layout['dtype'], 32)}-{key_component(layout['kv_cache_layout'], 32)}"
                        f"-t{tpc}-tp{par.tp_size}pp{par.pp_size}"
                        f"{f'pcp{par.pcp_size}' if par.pcp_size > 1 else ''}"
                        f"{f'dcp{par.dcp_size}' if par.dcp_size > 1 else ''}r{par.rank}"
                        f"{'-canon' if cfg.canonical_layout else ''}/")
    return layout


# Manifest fields that must match for the stored chunks to be readable, with
# the setting a user changes to fix a mismatch.
_MUST_MATCH = {
    "key_layout": "key_layout",
    "chunk_bytes": "page size (KV bytes per chunk: the model's layers, KV heads, head size, block_size)",
    "worker_kv_bytes_per_block": "page size (KV bytes per block per worker)",
    "groups": "the model's KV cache groups (layers)",
    "blocks_per_chunk": "blocks_per_chunk / block_size",
    "tokens_per_hash": "block_size",
    "replicated_layout": "replicated_layout",
}


@dataclass
class _Job:
    keys: list[Any]
    views: list[memoryview]
    future: concurrent.futures.Future[Any]
    is_load: bool
    start: float


class _Lookups(AsyncLookupManager):  # type: ignore[misc]
    """vLLM's batched, non-blocking lookup: one ``batch_contains`` per step
    (one request per storage target), on the manager's own thread."""

    def __init__(self, tier: TierFSSecondaryTier, tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[Any], req_context: Any) -> Iterable[bool]:
        return self._tier._contains(keys)


def _drop_offload_region(spec: Any) -> None:
    """The engine fails to start when this tier does: remove the name of its
    shared CPU offload region (``/dev/shm/vllm_offload_<engine>.mmap``).
    The workers made it before the scheduler makes the tiers, and vLLM's
    clean-up of a failed start unlinks only the scheduler's side, which did
    not create it: each failed start (a wrong pool, token or address) left
    its cpu_bytes_to_use of /dev/shm behind until stop 48. Mappings already
    made stay valid; nothing joins the region after a failed start."""
    engine = getattr(spec, "_engine_id", None)
    if isinstance(engine, str) and engine and "/" not in engine:
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/vllm_offload_{engine}.mmap")


class TierFSSecondaryTier(SecondaryTierManager):  # type: ignore[misc]
    """A TierFS KV pool as a vLLM secondary offloading tier (see the module doc)."""

    medium: ClassVar[Any] = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, meta: str | list[str] | None = None,
                 pool: str | None = None, token: str | None = None, namespace: str | None = None,
                 key_layout: str = "v1",
                 transport: str | None = None, connect_timeout: float = CONNECT_TIMEOUT,
                 batch_bytes: int = 32 << 20, batches_in_flight: int = 4, locality: str | None = None,
                 known_keys: int = 65536,
                 **unknown: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        try:
            self._setup(offloading_spec, primary_kv_view, tier_type, meta=meta, pool=pool, token=token, namespace=namespace,
                        key_layout=key_layout, transport=transport, connect_timeout=connect_timeout,
                        batch_bytes=batch_bytes, batches_in_flight=batches_in_flight, locality=locality,
                        known_keys=known_keys, unknown=unknown)
        except BaseException:
            _drop_offload_region(offloading_spec)
            raise

    def _setup(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str, *, meta: str | list[str] | None,
               pool: str | None, token: str | None, namespace: str | None, key_layout: str,
               transport: str | None, connect_timeout: float, batch_bytes: int, batches_in_flight: int,
               locality: str | None, known_keys: int, unknown: dict[str, Any]) -> None:
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(sorted(unknown))} (known: {', '.join(_SETTINGS)})",
                              field=f"{_WHERE} {sorted(unknown)[0]!r}")
        if key_layout not in KEY_LAYOUTS:
            raise ConfigError(f"unknown key layout {key_layout!r} (this TierFS writes {', '.join(KEY_LAYOUTS)})",
                              field=f"{_WHERE} 'key_layout'")
        if transport is not None and transport not in _TRANSPORTS:
            raise ConfigError(f"must be one of {', '.join(_TRANSPORTS)}, not {transport!r}",
                              field=f"{_WHERE} 'transport'")
        if not isinstance(connect_timeout, (int, float)) or not 0 < connect_timeout <= 300:
            raise ConfigError(f"must be seconds in (0, 300], not {connect_timeout!r}",
                              field=f"{_WHERE} 'connect_timeout'")
        if not isinstance(batch_bytes, int) or batch_bytes <= 0:
            raise ConfigError(f"must be a positive number of bytes, not {batch_bytes!r}",
                              field=f"{_WHERE} 'batch_bytes'")
        self._batch_bytes = batch_bytes
        if not isinstance(batches_in_flight, int) or isinstance(batches_in_flight, bool) or batches_in_flight <= 0:
            raise ConfigError(f"must be a positive number of batches, not {batches_in_flight!r}",
                              field=f"{_WHERE} 'batches_in_flight'")
        self._in_flight = batches_in_flight
        if namespace is not None and (not isinstance(namespace, str) or not namespace):
            raise ConfigError(f"must be a non-empty string, not {namespace!r}", field=f"{_WHERE} 'namespace'")
        if locality is not None:
            from vllm.v1.kv_offload.base import Locality

            try:
                self.locality = Locality(locality)
            except ValueError as e:
                raise ConfigError(f"must be LOCAL or REMOTE, not {locality!r}", field=f"{_WHERE} 'locality'") from e
        self._target = resolve({"meta": meta, "pool": pool, "token": token}, meta_key="meta", pool_key="pool",
                               where=_WHERE)
        self.pool = self._target.pool
        self.layout = layout_of(offloading_spec, self.block_size_bytes, key_layout, namespace)
        self.prefix: str = self.layout["prefix"]
        # A flat byte view of the primary buffer: rows are sliced from it for
        # each transfer and released when it ends; shutdown() drops it.
        self._flat: memoryview | None = primary_kv_view.cast("B")
        self._rows = len(self._flat) // self.block_size_bytes
        options = {"transport": transport} if transport else {}
        self._client: Client | None = connect(self._target, timeout=float(connect_timeout), **options)
        try:
            self._loop, aclient = self._client._ensure()
            self._akv = self._client._run(_on_loop(lambda: aclient.kv_pool(self.pool)))
            # Until the manifest is checked nothing is looked up or stored:
            # a pool that cannot answer now (no placement groups yet, its
            # daemon down) is retried from the lookup thread, and meanwhile
            # every lookup is a miss (until stop 46 the engine died here).
            self._manifest_ok = False
            self._manifest_retry_at = 0.0
            self._manifest_lock = threading.Lock()
            self._manifest_ready(startup=True)
        except BaseException:
            self._client.close()
            self._client = None
            self._flat.release()
            self._flat = None
            raise
        self._kv = self._client.kv_pool(self.pool)
        self._jobs: dict[int, _Job] = {}
        self._finished: queue.SimpleQueue[int] = queue.SimpleQueue()
        # Keys this tier saw stored or loaded: a store of one is skipped (the
        # pool would drop it as a duplicate, after it crossed the network).
        self._known: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._known_limit = max(0, int(known_keys))
        self._stats = OffloadingConnectorStats()
        self._label = (self.pool,)
        self._lookups = _Lookups(self, tier_type)
        log.info("TierFS secondary tier: pool %r at %s, keys %s*, %d-byte chunks",
                 self.pool, ",".join(self._target.meta), self.prefix, self.block_size_bytes)

    # ---- keys and the manifest -------------------------------------------------------

    def key_of(self, key: Any) -> bytes:
        """The TierFS key of a vLLM offload key (block hash + group index)."""
        return (f"{self.prefix}{get_offload_block_hash(key).hex()}.{get_offload_group_idx(key)}").encode()

    def _check_manifest(self) -> None:
        """Start-up only (it blocks): the namespace's manifest must describe
        chunks like this engine's. The first engine writes it; a put of an
        existing key is a no-op, so two engines starting at once agree."""
        assert self._client is not None
        kv = self._client.kv_pool(self.pool)
        mkey = f"{self.prefix}manifest"
        mine = {k: v for k, v in self.layout.items() if k != "prefix"}
        body = json.dumps(mine, sort_keys=True).encode()
        raw = kv.get(mkey)
        if raw is None:
            if kv.put(mkey, body):
                return
            raw = kv.get(mkey)
            if raw is None:  # evicted in between: nothing stored to contradict
                return
        try:
            theirs = json.loads(raw)
        except ValueError as e:
            raise ConfigError(f"the manifest {mkey!r} in pool {self.pool!r} is not JSON; delete it "
                              "(tierfs kv rm) or set another 'namespace'", field=f"{_WHERE} 'namespace'") from e
        for field, setting in _MUST_MATCH.items():
            if theirs.get(field) != mine.get(field):
                raise ConfigError(
                    f"the chunks stored under {self.prefix!r} in pool {self.pool!r} have {field}="
                    f"{theirs.get(field)!r} but this engine has {mine.get(field)!r}: {setting} does not match "
                    f"the stored objects. Use a 'namespace' of its own for this model, or the settings the "
                    f"objects were written with", field=f"{_WHERE} {('key_layout' if field == 'key_layout' else 'namespace')!r}")

    # ---- lookups (vLLM's lookup thread) -------------------------------------------------------

    def _manifest_ready(self, startup: bool = False) -> bool:
        """Whether the manifest was checked and matches. At start-up a
        mismatch raises (ConfigError); a pool that cannot answer does not:
        the check is tried again at most every MANIFEST_RETRY seconds, on
        the lookup thread. A mismatch found later is logged, and the tier
        stays all misses (nothing stored) until the engine is restarted."""
        if self._manifest_ok:
            return True
        now = time.monotonic()
        if now < self._manifest_retry_at or not self._manifest_lock.acquire(blocking=False):
            return False
        try:
            self._check_manifest()
        except ConfigError as e:
            if startup:
                raise
            log.error("TierFS pool %r: %s; every lookup is a miss and nothing is stored", self.pool, e)
            self._manifest_retry_at = float("inf")
            return False
        except TierFSError as e:
            log.warning("TierFS pool %r: cannot check the manifest %smanifest now (%s: %s): every lookup is a "
                        "miss and nothing is stored until it can (tried again every %.0f s)", self.pool,
                        self.prefix, type(e).__name__, e, MANIFEST_RETRY)
            self._manifest_retry_at = now + MANIFEST_RETRY
            return False
        finally:
            self._manifest_lock.release()
        self._manifest_ok = True
        if not startup:
            log.info("TierFS pool %r: manifest checked; lookups and stores resume", self.pool)
        return True

    def _contains(self, keys: Sequence[Any]) -> list[bool]:
        if self._client is None or not self._manifest_ready():
            return [False] * len(keys)
        return self._kv.batch_contains([self.key_of(k) for k in keys])

    # ---- SecondaryTierManager: the scheduler's step path -------------------------------------

    def on_new_request(self, req_context: Any) -> Any:
        return RequestOffloadingContext()

    def lookup(self, key: Any, req_context: Any) -> Any:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        if not found and self._known:
            # Gone from the pool (evicted, a daemon lost it): store it again.
            self._known.pop(self.key_of(key), None)
        return LookupResult.HIT if found else LookupResult.MISS

    def _row_views(self, chunk_ids: Any) -> list[memoryview]:
        assert self._flat is not None, "the tier is shut down"
        bs = self.block_size_bytes
        out = []
        for c in chunk_ids:
            c = int(c)
            if not 0 <= c < self._rows:
                raise ValueError(f"primary chunk {c} is outside the buffer's {self._rows} rows")
            out.append(self._flat[c * bs:(c + 1) * bs])
        return out

    def submit_store(self, job_metadata: Any) -> None:
        keys = list(job_metadata.keys)
        tkeys = [self.key_of(k) for k in keys]
        # Nothing is stored before the manifest is checked (see _manifest_ready).
        todo = [i for i, k in enumerate(tkeys) if k not in self._known] if self._manifest_ok else []
        if len(todo) < len(keys):
            self._stats.increase_counter(STORE_SKIPPED_CHUNKS, len(keys) - len(todo), self._label)
        chunk_ids = [job_metadata.chunk_ids[i] for i in todo]
        views = self._row_views(chunk_ids)
        self._start(job_metadata.job_id, [keys[i] for i in todo], views, False,
                    self._store([tkeys[i] for i in todo], views))

    def submit_load(self, job_metadata: Any) -> None:
        keys = list(job_metadata.keys)
        views = self._row_views(job_metadata.chunk_ids)
        self._start(job_metadata.job_id, keys, views, True,
                    self._load([self.key_of(k) for k in keys], views))

    def _start(self, job_id: int, keys: list[Any], views: list[memoryview], is_load: bool, coro: Any) -> None:
        # run_coroutine_threadsafe only queues the coroutine on the client's
        # loop (a write to its wake-up pipe): it never waits on the network.
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._jobs[job_id] = _Job(keys, views, fut, is_load, time.monotonic())
        fut.add_done_callback(functools.partial(self._job_done, job_id))

    def _job_done(self, job_id: int, _future: concurrent.futures.Future[Any]) -> None:
        self._finished.put(job_id)  # on the loop thread; SimpleQueue is thread-safe

    def _batches(self, n: int) -> list[range]:
        # A TierFS batch has one deadline for all its bytes (kv_timeout plus
        # its bytes at kv_min_bandwidth): bounded batches keep a stalled
        # daemon's cost short. A few run at once (batches_in_flight), so the
        # network is not idle between one batch's last reply and the next
        # batch's first request.
        per = max(1, self._batch_bytes // self.block_size_bytes)
        return [range(i, min(n, i + per)) for i in range(0, n, per)]

    async def _each_batch(self, n: int, one: Any) -> Exception | None:
        """``one(range)`` for every batch, ``batches_in_flight`` at a time;
        the last error (a failed batch does not stop the others)."""
        error: Exception | None = None
        sem = asyncio.Semaphore(self._in_flight)

        async def run(r: range) -> None:
            nonlocal error
            async with sem:
                try:
                    await one(r)
                except Exception as e:  # a cache: a failed batch is a later miss
                    error = e

        await asyncio.gather(*(run(r) for r in self._batches(n)))
        return error

    async def _store(self, tkeys: list[bytes], views: list[memoryview]) -> tuple[list[bool], Exception | None]:
        """Which keys the pool now has (stored, or there already), and the
        last error: a failed batch does not stop the others."""
        ok = [False] * len(tkeys)

        async def one(r: range) -> None:
            await self._akv.batch_put([tkeys[i] for i in r], [views[i] for i in r])
            for i in r:
                ok[i] = True

        return ok, await self._each_batch(len(tkeys), one)

    async def _load(self, tkeys: list[bytes], views: list[memoryview]) -> tuple[list[int | None], Exception | None]:
        sizes: list[int | None] = [None] * len(tkeys)

        async def one(r: range) -> None:
            got = await self._akv.batch_get_into([tkeys[i] for i in r], [views[i] for i in r], misfit="miss")
            for i, n in zip(r, got, strict=True):
                sizes[i] = n

        return sizes, await self._each_batch(len(tkeys), one)

    def get_finished_jobs(self) -> Iterable[Any]:
        # vLLM's manager polls this on every lookup (hundreds per step while
        # a promotion runs): the empty case must cost next to nothing.
        if self._finished.empty():
            return ()
        results = []
        while True:
            try:
                job_id = self._finished.get_nowait()
            except queue.Empty:
                break
            results.append(self._finish(job_id))
        return results

    def _finish(self, job_id: int) -> Any:
        job = self._jobs.pop(job_id)
        elapsed = time.monotonic() - job.start
        bs = self.block_size_bytes
        for v in job.views:
            # Still exported by a buffer the client holds: it goes with that.
            with contextlib.suppress(BufferError):
                v.release()
        raised = job.future.exception()
        n = len(job.keys)
        if not job.is_load:
            stored, error = job.future.result() if raised is None else ([False] * n, raised)
            for k, done in zip(job.keys, stored, strict=True):
                if done:
                    self._remember(self.key_of(k))
            good = sum(stored)
            if good < n:
                log.warning("TierFS store of %d of %d chunks to pool %r failed: %s", n - good, n, self.pool, error)
                self._stats.increase_counter(STORE_FAILED_CHUNKS, n - good, self._label)
                return JobResult(job_id=job_id, success=False, transfer_time=elapsed, transfer_bytes=good * bs)
            return JobResult(job_id=job_id, success=True, transfer_time=elapsed, transfer_bytes=n * bs)
        sizes, error = job.future.result() if raised is None else ([None] * n, raised)
        if error is not None:
            log.warning("TierFS load from pool %r failed for some of %d chunks: %s", self.pool, n, error)
        ok = [k for k, got in zip(job.keys, sizes, strict=True) if got == bs]
        for k in ok:
            self._remember(self.key_of(k))
        if len(ok) == len(job.keys):
            return JobResult(job_id=job_id, success=True, transfer_time=elapsed, transfer_bytes=len(ok) * bs)
        # A chunk the lookup saw that is gone now (evicted, its daemon down) or
        # has the wrong size: a miss; vLLM frees its row and recomputes it, and
        # the cached lookup verdict says miss so it is not promoted again.
        okset = set(ok)
        failed = [k for k in job.keys if k not in okset]
        self._lookups.mark_miss(failed)
        for k in failed:
            self._known.pop(self.key_of(k), None)
        self._stats.increase_counter(LOAD_FAILED_CHUNKS, len(failed), self._label)
        return JobResult(job_id=job_id, success=False, successful_keys=tuple(ok) if ok else None,
                         transfer_time=elapsed, transfer_bytes=len(ok) * bs)

    def _remember(self, tkey: bytes) -> None:
        if not self._known_limit:
            return
        self._known[tkey] = None
        self._known.move_to_end(tkey)
        while len(self._known) > self._known_limit:
            self._known.popitem(last=False)

    def has_pending_work(self) -> bool:
        # Keep the engine stepping until every transfer reported, so a store
        # that ends after its request does still release its primary row.
        return bool(self._jobs)

    def touch(self, keys: Any, req_context: Any) -> None:
        # The pool's eviction sees loads (gets), not presence checks, and the
        # KV protocol has no touch: forwarding one would cost a request per
        # step for keys that are being served from the device cache anyway.
        n = len(keys)
        if n:
            self._stats.increase_counter(TOUCHED_CHUNKS, n, self._label)

    def on_request_finished(self, req_context: Any) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: Any) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        """Block until every submitted transfer has ended (each TierFS request
        has its own deadline, so this is bounded); their results stay queued
        for ``get_finished_jobs``. Nothing is cancelled mid-copy."""
        pending = [j.future for j in self._jobs.values()]
        if pending:
            concurrent.futures.wait(pending)

    def shutdown(self) -> None:
        """Wait for in-flight transfers, stop the lookup thread, close the
        client and drop every view of the primary buffer (vLLM unmaps it next)."""
        if self._client is None:
            return
        self.drain_jobs()
        self.get_finished_jobs()
        self._lookups.shutdown()
        client, self._client = self._client, None
        client.close()
        if self._flat is not None:
            self._flat.release()
            self._flat = None
        self._primary_kv_view = None

    # ---- metrics -------------------------------------------------------------------------

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        doc: dict[str, str] = {
            LOAD_FAILED_CHUNKS: "Chunks a TierFS lookup found that the load did not return (evicted or lost "
                                "in between, or the daemon was down); vLLM recomputes them.",
            STORE_FAILED_CHUNKS: "Chunks whose store to TierFS failed (the pool was unreachable or full).",
            STORE_SKIPPED_CHUNKS: "Chunks not sent to TierFS because this tier already stored or loaded them.",
            TOUCHED_CHUNKS: "Chunk touches vLLM reported to the TierFS tier (not forwarded to the pool).",
        }
        out: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingCounterMetadata(documentation=text, labelnames=("pool",)) for name, text in doc.items()
        }
        return dict(out)

    def get_stats(self) -> Any:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, OffloadingConnectorStats()
        return stats


async def _on_loop(make: Any) -> Any:
    """``make()`` run on the client's loop thread (its objects belong there)."""
    return make()
