"""SGLang HiCache storage backend (the L3 tier under SGLang's host KV pool).

SGLang loads it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tierfs",
        "module_path": "tierfs.integrations.sglang",
        "class_name": "TierFSHiCacheStorage", "interface_v1": 1,
        "meta": "host:port,...", "pool": "default"}'

``meta`` and ``pool`` fall back to ``TIERFS_META``, ``TIERFS_KV_POOL`` and
the ``default`` pool (:mod:`tierfs.integrations.common`); a cluster that does
not answer, or an unknown pool, fails the server's start-up naming the
setting.

Objects. One SGLang page is stored as the host pool's own contiguous pieces,
so that a load lands straight in the page (``get_into`` the page views) and a
backup is sent straight from it (no staging copy):

- ``page_first`` / ``page_first_direct`` / ``page_head`` (MHA): one K and
  one V object per page; MLA: one object per page;
- ``layer_first``: one object per layer (and per K/V for MHA), since a page
  is contiguous only within a layer there.

Keys are ``sglang/<namespace>/<model>/<rank>/<format>/<page hash>/<piece>``
(``<model>``: the model's name made one key component, unique per name,
``tierfs.integrations.common.key_component``):
``<rank>`` is the TP rank and size for MHA (each rank holds its own heads)
and ``mla`` for MLA, whose KV every rank holds whole (only the storage writer
rank stores it: ``HiCacheStorageConfig.is_storage_writer``); ``<format>``
names the layout, page size, dtype and geometry, so that a server whose pages
differ never reads another's bytes as its own. A page-size manifest per
model and namespace makes a server started with another ``--page-size``
than the pages already stored fail at start-up (``ConfigError``), rather
than miss forever. A get whose object has another size than the page is a
miss, never partial bytes taken for a page.

The store is a cache: a dead storage daemon, a timeout or an evicted object
is a miss (``False``/``None``/a shorter prefix), never an exception into
SGLang's storage threads.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from tierfs.errors import ConfigError, InvalidArgumentError, TierFSError
from tierfs.integrations.common import CONNECT_TIMEOUT, Target, connect, key_component, resolve

__all__ = ["SUPPORTED_LAYOUTS", "TierFSHiCacheStorage"]

log = logging.getLogger(__name__)

#: Where SGLang's extra config is named in messages.
WHERE = "--hicache-storage-backend-extra-config"
#: The settings of the extra config this backend reads.
SETTINGS = ("meta", "pool", "token", "namespace", "timeout", "connect_timeout", "transport", "interface_v1")
#: Those SGLang itself reads from the same dict (0.5.x: the backend factory,
#: the cache controllers, the file backend's metadata cache). A key in
#: neither is logged as unknown, not refused: a later SGLang may read
#: keys this list does not know.
SGLANG_SETTINGS = ("backend_name", "module_path", "class_name", "tp_lcm_size", "prefetch_threshold",
                   "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "enable_metadata_cache",
                   "metadata_ttl", "file_storage_path")
#: Host pool layouts whose pages this backend reads and writes in place.
SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
_MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
#: Keys past this length are shortened (the KV API takes up to 512 bytes).
_MAX_PREFIX = 300


def _seconds(extra: dict[str, Any], key: str) -> float:
    v = extra[key]
    # Finite: NaN failed inside the client with a bare ValueError ("cannot
    # convert float NaN to integer"), and infinity was taken, so a stalled
    # daemon could hold SGLang's storage threads for ever.
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
        raise ConfigError(f"must be a finite number of seconds > 0, not {v!r}", field=f"{WHERE} {key!r}")
    return float(v)


class _Pages:
    """How one registered host pool's pages map onto objects: the piece
    names of a page and, for a page starting at host slot ``index``, the
    contiguous views of the pool's own memory that hold them."""

    def __init__(self, pool: Any) -> None:
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        self.layout: str = pool.layout
        self.page_size: int = int(pool.page_size)
        kind = type(pool)
        buf = getattr(pool, "kv_buffer", None)
        # Exact classes only: subclasses (MXFP8 scales, DSA indexers, hybrid
        # groups, asymmetric K/V) carry buffers these pieces would not cover.
        if kind is MHATokenToKVPoolHost and isinstance(buf, torch.Tensor):
            self.mla = False
            layouts: tuple[str, ...] = SUPPORTED_LAYOUTS
            layers, heads, dim = int(pool.layer_num), int(pool.head_num), int(pool.head_dim)
            self.geometry = f"L{layers}H{heads}D{dim}"
        elif kind is MLATokenToKVPoolHost and isinstance(buf, torch.Tensor):
            self.mla = True
            layouts = _MLA_LAYOUTS
            layers = int(pool.layer_num)
            self.geometry = f"L{layers}D{int(buf.shape[-1])}"
        else:
            raise ConfigError(
                f"TierFSHiCacheStorage stores pages of SGLang's MHATokenToKVPoolHost and MLATokenToKVPoolHost, "
                f"not {kind.__name__} (hybrid, sparse, quantized-scale and asymmetric K/V pools are not supported)",
                field="--hicache-mem-layout")
        if self.layout not in layouts:
            raise ConfigError(
                f"TierFSHiCacheStorage cannot read and write {'MLA' if self.mla else 'MHA'} pages in place with "
                f"layout {self.layout!r}; use one of {', '.join(layouts)}", field="--hicache-mem-layout")
        self.buf: torch.Tensor = buf
        self.layers = layers
        self.dtype = str(buf.dtype).removeprefix("torch.")
        self.format = f"{self.layout}-p{self.page_size}-{self.dtype}-{self.geometry}"
        if self.mla:
            self.names = [f"l{i}" for i in range(layers)] if self.layout == "layer_first" else ["kv"]
        elif self.layout == "layer_first":
            self.names = [f"{c}{i}" for c in "kv" for i in range(layers)]
        else:
            self.names = ["k", "v"]
        self.page_bytes = sum(v.numel() * v.element_size() for v in self.views(0))
        for v in self.views(0):
            if not v.is_contiguous():  # a layout change in SGLang would show here, not as wrong bytes
                raise ConfigError(f"host pool layout {self.layout!r} has non-contiguous pages "
                                  f"(shape {tuple(self.buf.shape)})", field="--hicache-mem-layout")

    def views(self, index: int) -> list[torch.Tensor]:
        b, ps, lay = self.buf, self.page_size, self.layout
        if self.mla:
            if lay == "layer_first":
                return [b[i, index:index + ps] for i in range(self.layers)]
            if lay == "page_first":
                return [b[index:index + ps]]
            return [b[index // ps]]
        if lay == "layer_first":
            return [b[c, i, index:index + ps] for c in (0, 1) for i in range(self.layers)]
        if lay == "page_first":
            return [b[c, index:index + ps] for c in (0, 1)]
        return [b[c, index // ps] for c in (0, 1)]


class TierFSHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """A ``HiCacheStorage`` over a TierFS KV pool: the generic interface
    (``get``/``set``/``batch_*``/``exists``) and the zero-copy one
    (``register_mem_pool_host``, ``batch_get_v1``/``batch_set_v1``)."""

    def __init__(self, storage_config: HiCacheStorageConfig | None = None, kwargs: Any = None) -> None:
        extra: dict[str, Any] = {}
        if storage_config is not None and storage_config.extra_config is not None:
            extra = storage_config.extra_config
            # SGLang picks the zero-copy page functions for a dynamic backend
            # only when extra_config says interface_v1; it reads the same dict
            # right after creating us, so default it on.
            extra.setdefault("interface_v1", 1)
        self.storage_config = storage_config
        #: Keys of the extra config that neither this backend nor SGLang
        #: reads (a misspelt "timout" would otherwise pass unnoticed).
        self.unknown_settings = sorted(str(k) for k in set(extra) - set(SETTINGS) - set(SGLANG_SETTINGS))
        if self.unknown_settings:
            log.warning("%s: unknown setting(s) %s, ignored (TierFS reads %s)", WHERE,
                        ", ".join(map(repr, self.unknown_settings)), ", ".join(SETTINGS))
        self.zero_copy = bool(extra.get("interface_v1", 1))
        self.target: Target = resolve(extra, meta_key="meta", pool_key="pool", where=WHERE)
        namespace = extra.get("namespace", "default")
        if not isinstance(namespace, str) or not namespace or "/" in namespace:
            raise ConfigError(f"must be a non-empty name without '/', not {namespace!r}",
                              field=f"{WHERE} 'namespace'")
        options: dict[str, Any] = {}
        if extra.get("timeout") is not None:
            options["kv_timeout"] = _seconds(extra, "timeout")
        if extra.get("transport") is not None:
            options["transport"] = extra["transport"]  # checked by ClientConfig
        connect_timeout = _seconds(extra, "connect_timeout") if extra.get("connect_timeout") is not None \
            else CONNECT_TIMEOUT
        self._client = connect(self.target, timeout=connect_timeout, **options)
        self._kv = self._client.kv_pool(self.target.pool)
        cfg = storage_config
        # The model's name as one key component, unique: until stop 46 its
        # slashes became dashes, so org/model-ft and org-model/ft (or a
        # local directory org-model-ft) read each other's pages.
        model = key_component(cfg.model_name) if cfg is not None and cfg.model_name else ""
        if cfg is None:
            rank, self.is_writer = "tp0-1", True
        else:
            rank = "mla" if cfg.is_mla_model else f"tp{cfg.tp_rank}-{cfg.tp_size}"
            if cfg.pp_size > 1:
                rank += f"_pp{cfg.pp_rank}-{cfg.pp_size}"
            if cfg.attn_cp_size > 1:
                rank += f"_cp{cfg.attn_cp_rank}-{cfg.attn_cp_size}"
            if cfg.dcp_size > 1:
                rank += f"_dcp{cfg.dcp_rank}-{cfg.dcp_size}"
            self.is_writer = bool(cfg.is_storage_writer)
        self._model_prefix = f"sglang/{namespace}/{model or '-'}"
        self._rank = rank
        self._prefix = self._make_prefix("unregistered")
        self.pages: _Pages | None = None
        self._lock = threading.Lock()
        self._written: set[str] = set()
        self._metrics: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bw": [],
                                                 "backup_bw": []}
        self.counters = {"pages_loaded": 0, "pages_missed": 0, "pages_stored": 0, "pages_present": 0,
                         "pages_failed": 0, "pages_skipped_not_writer": 0, "size_mismatches": 0, "errors": 0}
        log.info("TierFS HiCache storage: cluster %s, pool %r, keys %s/%s (zero-copy %s)",
                 ",".join(self.target.meta), self.target.pool, self._model_prefix, rank, self.zero_copy)

    # ---- keys ------------------------------------------------------------------------

    def _make_prefix(self, fmt: str) -> str:
        p = f"{self._model_prefix}/{self._rank}/{fmt}/"
        if len(p) > _MAX_PREFIX:
            p = "sglang/h/" + hashlib.sha256(p.encode()).hexdigest() + "/"
        return p

    def _page_key(self, key: str) -> str:
        return self._prefix + key

    def _piece_keys(self, key: str) -> list[str]:
        base = self._prefix + key + "/"
        if not self.zero_copy:
            return [base + "flat"]
        return [base + n for n in self._require_pages().names]

    def _require_pages(self) -> _Pages:
        if self.pages is None:
            raise RuntimeError("TierFSHiCacheStorage: register_mem_pool_host() has not been called "
                               "(SGLang's HiCacheController does it when it attaches the backend)")
        return self.pages

    # ---- registration ----------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        pages = _Pages(mem_pool_host)
        self._check_page_size(pages.page_size)
        super().register_mem_pool_host(mem_pool_host)
        self.pages = pages
        self._prefix = self._make_prefix(pages.format)
        log.info("TierFS HiCache storage: host pool %s, layout %s, %d pieces of %d bytes per page",
                 type(mem_pool_host).__name__, pages.layout, len(pages.names), pages.page_bytes)

    def _check_page_size(self, page_size: int) -> None:
        """A server whose page size differs from the pages this model already
        has in the pool would never hit them: say so at start-up."""
        key = f"{self._model_prefix}/manifest"
        mine = json.dumps({"page_size": page_size}, sort_keys=True).encode()
        try:
            got = self._kv.get(key)
            if got is None:
                self._kv.put(key, mine)
                got = self._kv.get(key)
        except TierFSError as e:
            log.warning("TierFS HiCache storage: page-size manifest %r unavailable (%s); not checked", key, e)
            return
        if got is None:
            return
        try:
            stored = json.loads(got)["page_size"]
        except (ValueError, KeyError, TypeError):
            log.warning("TierFS HiCache storage: unreadable page-size manifest %r; not checked", key)
            return
        if stored != page_size:
            raise ConfigError(
                f"this server's page size is {page_size} tokens but pool {self.target.pool!r} holds "
                f"{self._model_prefix.removeprefix('sglang/')}'s KV in pages of {stored} tokens: start with "
                f"--page-size {stored}, or give this server another {WHERE} 'namespace' (or 'pool')",
                field="--page-size")

    # ---- zero-copy interface ----------------------------------------------------------

    def _page_views(self, keys: Sequence[str], host_indices: torch.Tensor,
                    ) -> tuple[list[str], list[torch.Tensor], list[int]]:
        pages = self._require_pages()
        ps = pages.page_size
        if host_indices.numel() != len(keys) * ps:
            raise ValueError(f"{len(keys)} page keys need {len(keys) * ps} host indices, got {host_indices.numel()}")
        starts = host_indices.tolist()[::ps]
        okeys: list[str] = []
        views: list[torch.Tensor] = []
        owner: list[int] = []
        for i, (k, start) in enumerate(zip(keys, starts, strict=True)):
            base = self._prefix + k + "/"
            for name, v in zip(pages.names, pages.views(int(start)), strict=True):
                okeys.append(base + name)
                views.append(v)
                owner.append(i)
        return okeys, views, owner

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        t0 = time.perf_counter()
        okeys, views, owner = self._page_views(keys, host_indices)
        sizes = self._get_into(okeys, views)
        ok = [True] * len(keys)
        for j, (v, i, n) in enumerate(zip(views, owner, sizes, strict=True)):
            want = v.numel() * v.element_size()
            if n != want:
                if n is not None:
                    self._mismatch(okeys[j], n, want)
                ok[i] = False
        hits = sum(ok)
        self._account("prefetch", hits, time.perf_counter() - t0)
        self.counters["pages_loaded"] += hits
        self.counters["pages_missed"] += len(keys) - hits
        return ok

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not keys:
            return []
        if not self.is_writer:
            # MLA: every rank holds the same KV; the storage writer rank stores it.
            self.counters["pages_skipped_not_writer"] += len(keys)
            return [True] * len(keys)
        t0 = time.perf_counter()
        okeys, views, owner = self._page_views(keys, host_indices)
        ok = self._put(keys, okeys, views, owner)
        self._account("backup", sum(ok), time.perf_counter() - t0)
        return ok

    # ---- generic interface (flat pages: SGLang's non-zero-copy path) -------------------

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None,
            ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None,
                  ) -> list[torch.Tensor | None]:
        if not keys:
            return []
        okeys = [self._page_key(k) + "/flat" for k in keys]
        if target_locations is None:
            out: list[torch.Tensor | None] = []
            for k in okeys:
                data = self._safe(functools.partial(self._kv.get, k), None)
                out.append(None if data is None else torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return out
        dests = list(target_locations)
        sizes = self._get_into(okeys, dests)
        result: list[torch.Tensor | None] = []
        for k, d, n in zip(okeys, dests, sizes, strict=True):
            want = d.numel() * d.element_size()
            if n is not None and n != want:
                self._mismatch(k, n, want)
            result.append(d if n == want else None)
        return result

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any | None = None, target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            return False
        if not self.is_writer:
            return True
        bufs = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in values]
        okeys = [self._page_key(k) + "/flat" for k in keys]
        return all(self._put(list(keys), okeys, bufs, list(range(len(keys)))))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages are stored whole (every piece present)."""
        if not keys:
            return 0
        per_page = [self._piece_keys(k) for k in keys]
        flat = [k for ks in per_page for k in ks]
        present = self._safe(lambda: self._kv.batch_contains(flat), None)
        if present is None:
            return 0
        j = 0
        for i, ks in enumerate(per_page):
            if not all(present[j:j + len(ks)]):
                return i
            j += len(ks)
        return len(keys)

    def clear(self) -> bool:
        """Delete the pages this instance stored or found stored. TierFS has
        no prefix delete: other servers' pages stay until evicted."""
        with self._lock:
            written, self._written = self._written, set()
        ok = True
        for base in written:
            for k in self._piece_keys_of_base(base):
                if self._safe(functools.partial(self._kv.delete, k), None) is None:
                    ok = False
        return ok

    def _piece_keys_of_base(self, base: str) -> list[str]:
        if base.endswith("/flat"):
            return [base]
        return [base + n for n in self._require_pages().names]

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics since the last call (pages per batch and
        GB/s of each prefetch and backup), as ``--enable-storage-metrics``
        expects."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            m = {k: list(v) for k, v in self._metrics.items()}
            for v in self._metrics.values():
                v.clear()
        return StorageMetrics(prefetch_pgs=[int(x) for x in m["prefetch_pgs"]],
                              backup_pgs=[int(x) for x in m["backup_pgs"]],
                              prefetch_bandwidth=m["prefetch_bw"], backup_bandwidth=m["backup_bw"])

    def stats(self) -> dict[str, Any]:
        """Cumulative page counters and the TierFS pool's own counters."""
        return {**self.counters, "pool": self._kv.stats()}

    def close(self) -> None:
        self._client.close()

    # ---- internals --------------------------------------------------------------------

    def _safe(self, fn: Callable[[], Any], default: Any) -> Any:
        try:
            return fn()
        except TierFSError as e:
            self.counters["errors"] += 1
            log.warning("TierFS HiCache storage: %s: %s (treated as a miss)", type(e).__name__, e)
            return default

    def _get_into(self, okeys: list[str], dests: list[Any]) -> list[int | None]:
        try:
            # An object that is not a page (larger than its buffer, or not
            # whole elements): that key's miss, not the batch's.
            got: list[int | None] = self._kv.batch_get_into(okeys, dests, misfit="miss")
            return got
        except InvalidArgumentError as e:
            self.counters["size_mismatches"] += 1
            log.error("TierFS HiCache storage: %s; treated as a miss", e)
            return [None] * len(okeys)
        except TierFSError as e:
            self.counters["errors"] += 1
            log.warning("TierFS HiCache storage: get of %d objects failed: %s (misses)", len(okeys), e)
            return [None] * len(okeys)

    def _put(self, keys: Sequence[str], okeys: list[str], bufs: list[Any], owner: list[int]) -> list[bool]:
        """Store the objects of each page that are not there yet; per page,
        True when all its objects are stored."""
        present = self._safe(lambda: self._kv.batch_contains(okeys), None) or [False] * len(okeys)
        todo = [j for j in range(len(okeys)) if not present[j]]
        ok = [True] * len(keys)
        if todo:
            try:
                self._kv.batch_put([okeys[j] for j in todo], [bufs[j] for j in todo])
            except TierFSError as e:
                # The batch says which keys it stored (an EC batch stops at
                # the key that failed: the rest were not tried, None too).
                # The other pages are put again one by one, in order, up to
                # the first that fails: SGLang takes a backup batch as done
                # only when every page is (all() in its controller) and
                # reads pages as a prefix, so pages after a failed one are
                # of no use, and each retry can wait a whole kv_timeout on
                # a stalled daemon. Until this change every page was retried:
                # a 128-page batch with a daemon stalled held SGLang's backup
                # thread for 129 kv_timeouts (puts wait on a stalled target
                # until the map calls it down).
                results = e.batch_results
                done = {j for n, j in enumerate(todo) if results is not None and n < len(results)
                        and results[n] is not None}
                log.warning("TierFS HiCache storage: batch put failed (%s); retrying page by page", e)
                failed = False
                for i in sorted({owner[j] for j in todo}):
                    mine = [j for j in todo if owner[j] == i and j not in done]
                    if not mine:
                        continue
                    if failed:
                        ok[i] = False
                        continue
                    try:
                        self._kv.batch_put([okeys[j] for j in mine], [bufs[j] for j in mine])
                    except TierFSError as e2:
                        self.counters["errors"] += 1
                        log.warning("TierFS HiCache storage: page %s not stored (%s); the later pages of "
                                    "this batch not stored yet are not tried", keys[i], e2)
                        ok[i] = False
                        failed = True
        stored_pages = {owner[j] for j in todo}
        first: dict[int, str] = {}
        for j, i in enumerate(owner):
            first.setdefault(i, okeys[j])
        with self._lock:
            for i, base in first.items():
                if ok[i]:
                    self._written.add(base if base.endswith("/flat") else base.rsplit("/", 1)[0] + "/")
        n_ok = sum(ok)
        self.counters["pages_stored"] += sum(1 for i in stored_pages if ok[i])
        self.counters["pages_present"] += sum(1 for i in range(len(keys)) if ok[i] and i not in stored_pages)
        self.counters["pages_failed"] += len(keys) - n_ok
        return ok

    def _mismatch(self, key: str, got: int, want: int) -> None:
        self.counters["size_mismatches"] += 1
        log.error("TierFS HiCache storage: object %r has %d bytes, the page %d: treated as a miss "
                  "(a page-size or layout mismatch?)", key, got, want)

    def _account(self, what: str, pages: int, seconds: float) -> None:
        pages_bytes = self.pages.page_bytes if self.pages is not None else 0
        with self._lock:
            self._metrics[f"{what}_pgs"].append(pages)
            if seconds > 0:
                self._metrics[f"{what}_bw"].append(pages * pages_bytes / seconds / 1e9)
