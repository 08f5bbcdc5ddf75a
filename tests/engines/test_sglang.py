"""SGLang HiCache (0.5.23) over TierFS: SGLang's own code drives
``tierfs.integrations.sglang.TierFSHiCacheStorage`` against the live cluster.

SGLang runs in worker processes ("servers", ``python -m
tests.engines.test_sglang``), one per server, because importing it here
would leak its import shims (triton, torchvision, IPython:
``tests/engines/_shims/sglang_cpu.py``) and its transformers patches into
the other engines' tests in this session, and its import-time warnings into
pytest's ``filterwarnings = error``. Each worker builds SGLang's real
classes on CPU: a device pool (``MHATokenToKVPool`` / ``MLATokenToKVPool``),
the host pool over it (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``)
and a ``HiCacheController`` whose ``attach_storage_backend`` calls SGLang's
``StorageBackendFactory`` with the ``dynamic`` extra config; the test calls
SGLang's controller and backend methods there and checks the bytes of
SGLang's own pages (``get_data_page``).

Not run here (CUDA): the device<->host copies (``HiCacheController.write`` /
``load``: ``sgl_kernel.kvcacheio`` transfer kernels); pages are written
into the host pool directly, as those copies would.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engines.conftest import REPO

pytestmark = pytest.mark.timeout(60)
if __name__ != "__main__" and importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed in this venv (make engines)", allow_module_level=True)

SHIMS = Path(__file__).resolve().parent / "_shims"
MODULE = "tierfs.integrations.sglang"
WHERE = "--hicache-storage-backend-extra-config"
EXTRA = {"backend_name": "tierfs", "module_path": MODULE, "class_name": "TierFSHiCacheStorage"}
PAGE = 4  # tokens per page
GEOMETRY = {"layers": 3, "heads": 2, "head_dim": 8}


# ==== the worker: one SGLang "server" process ==========================================

_S: dict[str, Any] = {}


def _w_init() -> dict[str, Any]:
    sys.path.insert(0, str(SHIMS))
    import sglang_cpu

    sglang_cpu.install()
    import sglang.srt.managers.cache_controller  # the import is the slow part: do it now
    import sglang.srt.mem_cache.storage  # noqa: F401
    from sglang.srt.runtime_context import get_parallel

    import tierfs.integrations.sglang  # noqa: F401

    # The controller reads the topology from SGLang's runtime context, which a
    # launched server publishes; here: one rank, no PP/CP/DP.
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1,
                                        attn_dcp_rank=0, attn_tp_rank=0, attn_tp_size=1, attn_dp_rank=0)
    return {"pid": os.getpid()}


def _host_pool(layout: str, page_size: int, mla: bool) -> tuple[Any, Any]:
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    g = GEOMETRY
    if mla:
        dev = MLATokenToKVPool(size=64, page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=16,
                               qk_rope_head_dim=8, layer_num=g["layers"], device="cpu", enable_memory_saver=False)
        info = dev.get_device_pool_infos()[0].buffer_info
        host = MLATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=dev.size, start_layer=0, end_layer=g["layers"],
                                    target_layer_num=g["layers"])
    else:
        dev = MHATokenToKVPool(size=64, page_size=page_size, dtype=torch.bfloat16, head_num=g["heads"],
                               head_dim=g["head_dim"], layer_num=g["layers"], device="cpu",
                               enable_memory_saver=False, enable_alt_stream=False)
        info = dev.get_device_pool_infos()[0].buffer_info
        host = MHATokenToKVPoolHost(info, 2.0, 0, page_size, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=dev.size, start_layer=0, end_layer=g["layers"])
    return dev, host


def _w_controller(name: str, layout: str, extra: dict[str, Any], page_size: int = PAGE,
                  model: str = "tiny/llama") -> dict[str, Any]:
    """A HiCacheController with storage attached the way a server starts:
    SGLang's factory creates the backend from the dynamic extra config."""
    from sglang.srt.managers.cache_controller import HiCacheController

    dev, host = _host_pool(layout, page_size, mla=False)

    class Allocator:  # the device allocator: only what the controller asks of it
        def get_kvcache(self) -> Any:
            return dev

        def set_hicache_transfer_done_event(self, *a: Any) -> None:
            pass

    ctl = HiCacheController(Allocator(), host, page_size, None, threading.Event(), io_backend="direct",
                            storage_backend="dynamic", model_name=model,
                            storage_backend_extra_config=dict(extra))
    _S[name] = {"ctl": ctl, "host": host, "backend": ctl.storage_backend, "page": page_size}
    be = ctl.storage_backend
    return {"backend": f"{type(be).__module__}.{type(be).__name__}",
            "registered": type(be.mem_pool_host).__name__, "layout": host.layout,
            "page_get": ctl.page_get_func.__name__, "page_set": ctl.page_set_func.__name__,
            "pieces": len(be.pages.names), "zero_copy": be.zero_copy, "unknown": be.unknown_settings}


def _w_backend(name: str, layout: str, extra: dict[str, Any], mla: bool = False, tp_rank: int = 0,
               tp_size: int = 1, model: str = "tiny/llama") -> dict[str, Any]:
    """A backend straight from SGLang's factory, for ranks the one-rank
    controller cannot be (TP > 1, MLA)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    _, host = _host_pool(layout, PAGE, mla)
    cfg = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                               is_page_first_layout=layout == "page_first", model_name=model,
                               extra_config=dict(extra))
    be = StorageBackendFactory.create_backend("dynamic", cfg, host)
    be.register_mem_pool_host(host)
    _S[name] = {"host": host, "backend": be, "page": PAGE}
    return {"writer": be.is_writer, "pieces": len(be.pages.names)}


def _w_keys(name: str, tokens: list[int]) -> list[str]:
    """SGLang's own page hashes of a token sequence (what the radix cache keys on)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return list(get_storage_hash_str(tokens, None, page_size=_S[name]["page"]))


def _digests(name: str, indices: list[int]) -> list[str]:
    s = _S[name]
    host, ps = s["host"], s["page"]
    return [hashlib.sha256(host.get_data_page(indices[i], flat=True).contiguous().view(-1).view(
        __import__("torch").uint8).numpy().tobytes()).hexdigest() for i in range(0, len(indices), ps)]


def _w_fill(name: str, pages: int, seed: int) -> dict[str, Any]:
    """Allocate pages in the host pool and give them seeded random KV (what
    the device-to-host copy would have written); their digests."""
    import torch

    s = _S[name]
    host = s["host"]
    idx = host.alloc(pages * s["page"])
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn((pages, host.get_dummy_flat_data_page().numel()), generator=gen).to(host.dtype)
    for p in range(pages):
        host.set_from_flat_data_page(int(idx[p * s["page"]]), flat[p])
    indices = idx.tolist()
    return {"indices": indices, "digests": _digests(name, indices)}


def _w_zero(name: str) -> None:
    _S[name]["host"].kv_buffer.zero_()


def _w_alloc(name: str, pages: int) -> list[int]:
    s = _S[name]
    return list(s["host"].alloc(pages * s["page"]).tolist())


def _w_set_v1(name: str, keys: list[str], indices: list[int]) -> list[bool]:
    import torch

    return list(_S[name]["backend"].batch_set_v1(keys, torch.tensor(indices, dtype=torch.int64)))


def _w_get_v1(name: str, keys: list[str], indices: list[int]) -> dict[str, Any]:
    import torch

    ok = _S[name]["backend"].batch_get_v1(keys, torch.tensor(indices, dtype=torch.int64))
    return {"ok": list(ok), "digests": _digests(name, indices)}


def _w_exists(name: str, keys: list[str]) -> int:
    return int(_S[name]["backend"].batch_exists(keys))


def _w_drop_piece(name: str, key: str, piece: str) -> bool:
    """Delete one stored object of one page (as an eviction would)."""
    be = _S[name]["backend"]
    return bool(be._kv.delete(be._prefix + key + "/" + piece))


def _w_put_raw(name: str, key: str, piece: str, nbytes: int) -> bool:
    be = _S[name]["backend"]
    return bool(be._kv.put(be._prefix + key + "/" + piece, bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256),
                           overwrite=True))


def _w_call(name: str, method: str, *args: Any) -> Any:
    r = getattr(_S[name]["backend"], method)(*args)
    return r if isinstance(r, (bool, int, type(None))) else repr(r)


def _w_stats(name: str) -> dict[str, Any]:
    be = _S[name]["backend"]
    m = be.get_stats()
    return {"counters": dict(be.counters), "metrics": type(m).__name__, "prefetch_pgs": list(m.prefetch_pgs),
            "backup_pgs": list(m.backup_pgs)}


def _w_backup(name: str, tokens: list[int], indices: list[int], timeout: float = 20.0) -> int:
    """HiCache's write-through to storage: the controller's backup thread."""
    import torch

    ctl = _S[name]["ctl"]
    keys = _w_keys(name, tokens)
    op_id = ctl.write_storage(torch.tensor(indices, dtype=torch.int64), tokens, hash_value=keys)
    op = ctl.ack_backup_queue.get(timeout=timeout)
    assert op.id == op_id
    return int(op.completed_tokens)


def _w_prefetch(name: str, tokens: list[int], timeout: float = 20.0) -> dict[str, Any]:
    """HiCache's prefetch from storage: the prefetch thread's hit query
    (``batch_exists``), then, playing the scheduler's part (host slots for
    the hit), the I/O thread's page transfer (``batch_get_v1``) and the
    sync thread's acks."""
    ctl = _S[name]["ctl"]
    op = ctl.prefetch(f"req-{time.monotonic_ns()}", tokens)
    hit_op = ctl.prefetch_hit_queue.get(timeout=timeout)
    assert hit_op is op
    hit = int(op.storage_hit_count)
    if hit == 0:
        return {"hit_tokens": 0, "loaded_tokens": 0, "indices": [], "digests": []}
    op.host_indices = ctl.mem_pool_host.alloc(hit)
    ctl.prefetch_buffer.put(op)
    loaded = 0
    deadline = time.monotonic() + timeout
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=max(0.1, deadline - time.monotonic()))
        if ack.completed_tokens is not None:
            loaded = max(loaded, int(ack.completed_tokens))
        if ack.completed_req:
            break
    indices = op.host_indices.tolist()
    return {"hit_tokens": hit, "loaded_tokens": loaded, "indices": indices, "digests": _digests(name, indices)}


def _worker_main() -> None:
    # Answers go to the original stdout; anything SGLang prints goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    out.write(json.dumps({"ok": _w_init()}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            res = {"ok": globals()["_w_" + req["fn"]](*req.get("args", []), **req.get("kw", {}))}
        except BaseException as e:
            res = {"error": type(e).__name__, "message": str(e), "mro": [c.__name__ for c in type(e).__mro__]}
        out.write(json.dumps(res) + "\n")


# ==== the test side ====================================================================


class WorkerError(Exception):
    def __init__(self, kind: str, message: str, mro: list[str]) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.mro = kind, message, mro


class Server:
    """One SGLang worker process; ``call(fn, ...)`` runs ``_w_<fn>`` there."""

    def __init__(self, name: str, log: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, log
        self._err = log.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.engines.test_sglang"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True)
        self._answers: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._answers.put(line)
        self._answers.put("")

    def call(self, fn: str, *args: Any, timeout: float = 40.0, **kw: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"fn": fn, "args": args, "kw": kw}) + "\n")
        self.proc.stdin.flush()
        return self.answer(fn, timeout)

    def answer(self, fn: str, timeout: float) -> Any:
        try:
            line = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name}: {fn} gave no answer in {timeout} s; log:\n{self.tail()}") from None
        if not line:
            raise AssertionError(f"{self.name} exited ({self.proc.poll()}); log:\n{self.tail()}")
        res = json.loads(line)
        if "error" in res:
            raise WorkerError(res["error"], res["message"], res["mro"])
        return res["ok"]

    def tail(self) -> str:
        self._err.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._err.close()


@pytest.fixture(scope="module")
def servers(tierfs_meta: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """Two SGLang servers. A finds the cluster through TIERFS_META (the
    fallback), B through the extra config's ``meta``."""
    d = tmp_path_factory.mktemp("sglang")
    base = {**os.environ, "PYTHONPATH": str(REPO)}
    a = Server("server-a", d / "a.log", {**base, "TIERFS_META": tierfs_meta})
    b = Server("server-b", d / "b.log", {k: v for k, v in base.items() if k != "TIERFS_META"})
    try:
        for s in (a, b):  # both import SGLang at once
            s.answer("start-up", timeout=90)
        yield a, b
    finally:
        a.close()
        b.close()


def extra(pool: str, **kw: Any) -> dict[str, Any]:
    return {**EXTRA, "pool": pool, **kw}


def tokens(n_pages: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 32000 for i in range(n_pages * PAGE)]


def test_factory_dynamic_config(servers: tuple[Server, Server], fresh_pool: str,
                                                    tierfs_meta: str) -> None:
    a, b = servers
    info = a.call("controller", "fa", "page_first", extra(fresh_pool))
    assert info["backend"] == f"{MODULE}.TierFSHiCacheStorage"
    assert info["registered"] == "MHATokenToKVPoolHost"
    # interface_v1 defaulted on: SGLang chose its zero-copy page functions.
    assert (info["page_get"], info["page_set"]) == ("_page_get_zero_copy", "_page_set_zero_copy")
    assert info["pieces"] == 2 and info["zero_copy"]
    assert info["unknown"] == []
    info = b.call("controller", "fb", "layer_first", extra(fresh_pool, meta=tierfs_meta))
    assert info["pieces"] == 2 * GEOMETRY["layers"] and info["layout"] == "layer_first"
    # A misspelt setting starts (SGLang's own keys share the dict, and a
    # later SGLang may read keys TierFS does not know) but is named in a
    # warning; SGLang's own keys are not.
    info = a.call("controller", "fc", "page_first",
                  extra(fresh_pool, timout=3, prefetch_threshold=128, enable_metadata_cache=True))
    assert info["unknown"] == ["timout"]


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_v1_round_trip(servers: tuple[Server, Server], fresh_pool: str, layout: str) -> None:
    a, _ = servers
    n = f"rt-{layout}"
    a.call("controller", n, layout, extra(fresh_pool))
    keys = a.call("keys", n, tokens(5, seed=1))
    filled = a.call("fill", n, 5, 11)
    assert a.call("set_v1", n, keys, filled["indices"]) == [True] * 5
    a.call("zero", n)
    dest = a.call("alloc", n, 5)  # other host slots than the stored ones, in a cleared pool
    got = a.call("get_v1", n, keys, dest)
    assert got["ok"] == [True] * 5
    assert got["digests"] == filled["digests"]
    stats = a.call("stats", n)
    assert stats["metrics"] == "StorageMetrics" and stats["prefetch_pgs"] == [5] and stats["backup_pgs"] == [5]


def test_batch_exists_prefix(servers: tuple[Server, Server], fresh_pool: str) -> None:
    a, _ = servers
    a.call("controller", "ex", "page_first", extra(fresh_pool))
    keys = a.call("keys", "ex", tokens(6, seed=2))
    filled = a.call("fill", "ex", 5, 12)
    assert a.call("exists", "ex", keys) == 0
    assert a.call("set_v1", "ex", keys[:5], filled["indices"]) == [True] * 5
    assert a.call("exists", "ex", keys) == 5
    assert a.call("exists", "ex", keys[:3]) == 3
    assert a.call("call", "ex", "exists", keys[4]) is True
    # A hole in the middle: page 2 lost its V object (evicted): 2 pages usable.
    assert a.call("drop_piece", "ex", keys[2], "v")
    assert a.call("exists", "ex", keys) == 2
    dest = a.call("alloc", "ex", 5)
    assert a.call("get_v1", "ex", keys[:5], dest)["ok"] == [True, True, False, True, True]
    # clear() removes what this server stored.
    assert a.call("call", "ex", "clear") is True
    assert a.call("exists", "ex", keys[:1]) == 0 and a.call("call", "ex", "exists", keys[4]) is False


def test_controller_cross_server(servers: tuple[Server, Server],
                                                                  fresh_pool: str, tierfs_meta: str) -> None:
    a, b = servers
    a.call("controller", "ca", "page_first", extra(fresh_pool))
    toks = tokens(6, seed=3)
    filled = a.call("fill", "ca", 6, 13)
    assert a.call("backup", "ca", toks, filled["indices"]) == len(toks)
    a.call("zero", "ca")
    got = a.call("prefetch", "ca", toks)
    assert got["hit_tokens"] == got["loaded_tokens"] == len(toks)
    assert got["digests"] == filled["digests"]
    # Another server (process, client, controller) on the same cluster and
    # pool hits what A stored, and loads the same bytes.
    b.call("controller", "cb", "page_first", extra(fresh_pool, meta=tierfs_meta))
    got_b = b.call("prefetch", "cb", toks + tokens(2, seed=99))
    assert got_b["hit_tokens"] == got_b["loaded_tokens"] == len(toks)
    assert got_b["digests"] == filled["digests"]
    # A server with another layout never reads these pages as its own.
    b.call("controller", "cb-lf", "layer_first", extra(fresh_pool, meta=tierfs_meta))
    assert b.call("prefetch", "cb-lf", toks)["hit_tokens"] == 0


def test_generic_interface(servers: tuple[Server, Server], fresh_pool: str) -> None:
    a, _ = servers
    info = a.call("controller", "g", "layer_first", extra(fresh_pool, interface_v1=0))
    assert (info["page_get"], info["page_set"]) == ("_generic_page_get", "_generic_page_set")
    toks = tokens(3, seed=4)
    filled = a.call("fill", "g", 3, 14)
    assert a.call("backup", "g", toks, filled["indices"]) == len(toks)
    a.call("zero", "g")
    got = a.call("prefetch", "g", toks)
    assert got["loaded_tokens"] == len(toks) and got["digests"] == filled["digests"]


def test_tp_ranks_and_mla(servers: tuple[Server, Server], fresh_pool: str, tierfs_meta: str) -> None:
    meta = tierfs_meta
    a, b = servers
    # MHA: each TP rank holds its own heads under its own keys.
    a.call("backend", "r0", "page_first", extra(fresh_pool), tp_rank=0, tp_size=2)
    b.call("backend", "r1", "page_first", extra(fresh_pool, meta=meta), tp_rank=1, tp_size=2)
    keys = a.call("keys", "r0", tokens(2, seed=5))
    assert a.call("set_v1", "r0", keys, a.call("fill", "r0", 2, 15)["indices"]) == [True, True]
    assert a.call("exists", "r0", keys) == 2
    assert b.call("exists", "r1", keys) == 0
    # MLA: every rank holds the same KV; only the writer rank stores it, and
    # every rank loads it.
    a.call("backend", "m1", "page_first", extra(fresh_pool), mla=True, tp_rank=1, tp_size=2)
    b.call("backend", "m0", "page_first", extra(fresh_pool, meta=meta), mla=True, tp_rank=0, tp_size=2)
    filled = a.call("fill", "m1", 2, 16)
    assert a.call("set_v1", "m1", keys, filled["indices"]) == [True, True]  # not the writer: skipped
    assert a.call("exists", "m1", keys) == 0
    filled0 = b.call("fill", "m0", 2, 16)
    assert b.call("set_v1", "m0", keys, filled0["indices"]) == [True, True]
    a.call("zero", "m1")
    got = a.call("get_v1", "m1", keys, a.call("alloc", "m1", 2))
    assert got["ok"] == [True, True] and got["digests"] == filled0["digests"] == filled["digests"]


def test_killed_storage_is_a_miss(servers: tuple[Server, Server], fresh_pool: str,
                                         killed_storage: Callable[[str], None]) -> None:
    a, _ = servers
    a.call("controller", "k", "page_first", extra(fresh_pool))
    toks = tokens(8, seed=6)
    keys = a.call("keys", "k", toks)
    filled = a.call("fill", "k", 8, 17)
    assert a.call("backup", "k", toks, filled["indices"]) == len(toks)
    killed_storage("storage-1")
    t0 = time.monotonic()
    n = a.call("exists", "k", keys)
    assert n < 8  # 16 objects over 3 daemons: some were on the dead one
    got = a.call("get_v1", "k", keys, a.call("alloc", "k", 8))
    assert not all(got["ok"])
    pre = a.call("prefetch", "k", toks)
    assert pre["loaded_tokens"] == pre["hit_tokens"] == n * PAGE < len(toks)
    assert pre["digests"] == filled["digests"][:n]  # the prefix that survived loads right
    # A backup whose objects would go to the dead daemon: False for those pages, no exception.
    again = a.call("set_v1", "k", keys, filled["indices"])
    assert len(again) == 8 and False in again and again[:n] == [True] * n
    assert time.monotonic() - t0 < 30


def _start_error(server: Server, *args: Any, **kw: Any) -> WorkerError:
    with pytest.raises(WorkerError) as ei:
        server.call("controller", *args, **kw)
    return ei.value


def test_bad_configuration(servers: tuple[Server, Server], fresh_pool: str,
                                                             tierfs_cluster: Any) -> None:
    a, b = servers
    t0 = time.monotonic()
    # SGLang's attach re-raises the ValueError (our ConfigError) as "Failed to
    # create storage backend: <ours>", and the server does not start.
    e = _start_error(b, "bad1", "page_first", extra(fresh_pool, meta="127.0.0.1:1", connect_timeout=2))
    assert "ValueError" in e.mro and f"{WHERE} 'meta'" in e.message and "127.0.0.1:1" in e.message
    e = _start_error(b, "bad2", "page_first", extra(fresh_pool))  # no meta, no TIERFS_META
    assert "TIERFS_META" in e.message and f"{WHERE} 'meta'" in e.message
    e = _start_error(a, "bad3", "page_first", extra("no-such-pool"))
    assert f"{WHERE} 'pool'" in e.message and "no-such-pool" in e.message
    e = _start_error(a, "bad3b", "page_first", extra(fresh_pool, connect_timeout="soon"))
    assert f"{WHERE} 'connect_timeout'" in e.message
    e = _start_error(a, "bad4", "page_unified", extra(fresh_pool))
    assert "--hicache-mem-layout" in e.message
    # The pool holds this model's pages of PAGE tokens; a server started with
    # another page size fails at start-up, naming --page-size.
    a.call("controller", "ok", "page_first", extra(fresh_pool))
    e = _start_error(a, "bad5", "page_first", extra(fresh_pool), page_size=2 * PAGE)
    assert "--page-size" in e.message and f"--page-size {PAGE}" in e.message
    # ...unless it keeps its pages apart.
    a.call("controller", "ok2", "page_first", extra(fresh_pool, namespace="p8"), page_size=2 * PAGE)
    assert time.monotonic() - t0 < 40


def test_timeouts_that_are_not_finite_are_refused_at_start_up(servers: tuple[Server, Server],
                                                              fresh_pool: str) -> None:
    """NaN failed inside the client with a bare ValueError naming no setting,
    and infinity was taken (a stalled daemon could then hold SGLang's
    storage threads for ever); JSON's parser reads both (NaN, Infinity, 1e999)."""
    a, _ = servers
    for key in ("timeout", "connect_timeout"):
        for value in (float("nan"), float("inf")):
            e = _start_error(a, f"bad-{key}-{value}", "page_first", extra(fresh_pool, **{key: value}))
            assert f"{WHERE} {key!r}" in e.message and "finite" in e.message, e.message


def test_wrong_size_object_is_a_miss(servers: tuple[Server, Server], fresh_pool: str) -> None:
    """Bytes under a page's key that are not that page (a foreign writer, a
    bug): a miss, never partial bytes taken for the page."""
    a, _ = servers
    a.call("controller", "sz", "page_first", extra(fresh_pool))
    keys = a.call("keys", "sz", tokens(3, seed=7))
    filled = a.call("fill", "sz", 3, 18)
    assert a.call("set_v1", "sz", keys[:1], filled["indices"][:PAGE]) == [True]
    piece = GEOMETRY["layers"] * GEOMETRY["heads"] * GEOMETRY["head_dim"] * PAGE * 2  # bf16 bytes
    a.call("put_raw", "sz", keys[1], "k", piece // 2)
    a.call("put_raw", "sz", keys[1], "v", piece // 2)
    a.call("put_raw", "sz", keys[2], "k", piece * 2)
    a.call("put_raw", "sz", keys[2], "v", piece)
    got = a.call("get_v1", "sz", keys, a.call("alloc", "sz", 3))
    assert got["ok"] == [True, False, False]
    assert got["digests"][0] == filled["digests"][0]
    assert a.call("stats", "sz")["counters"]["size_mismatches"] >= 2


if __name__ == "__main__":
    _worker_main()


def test_models_whose_names_differ_only_in_slashes_never_share_pages(servers: tuple[Server, Server],
                                                                     fresh_pool: str, tierfs_meta: str) -> None:
    """Until stop 46 the model's name went into the keys with its slashes
    made dashes: a server of org-model/ft or org-model-ft (a fine-tune in a
    local directory) read the pages a server of org/model-ft stored, as its
    own (same geometry, same page hashes)."""
    a, b = servers
    a.call("backend", "hub", "page_first", extra(fresh_pool), model="org/model-ft")
    keys = a.call("keys", "hub", tokens(3, seed=21))
    assert a.call("set_v1", "hub", keys, a.call("fill", "hub", 3, 21)["indices"]) == [True] * 3
    assert a.call("exists", "hub", keys) == 3  # the control: its own pages
    for i, other in enumerate(("org-model/ft", "org-model-ft", "org_model-ft")):
        b.call("backend", f"other{i}", "page_first", extra(fresh_pool, meta=tierfs_meta), model=other)
        assert b.call("exists", f"other{i}", keys) == 0, other
        got = b.call("get_v1", f"other{i}", keys, b.call("alloc", f"other{i}", 3))
        assert got["ok"] == [False] * 3, other


@pytest.mark.timeout(240)
def test_a_failed_backup_with_a_daemon_stalled_retries_one_page_not_each(
        servers: tuple[Server, Server], tmp_path_factory: pytest.TempPathFactory) -> None:
    """``ec:2+1`` on three daemons, one stalled (SIGSTOP) and never called
    down (meta's heartbeat timeout is longer than the test): every put waits
    on it for the whole ``kv_timeout``. A backup batch fails; the pages it did
    not store are retried one by one only up to the first that fails, since
    SGLang's controller takes a batch as done only when all its pages are and
    reads pages as a prefix. Until this change every page was retried, each
    a whole ``kv_timeout`` (a 128-page batch: 129 of them, SGLang's backup
    thread held all along). Counted, not timed: one page retry fails."""
    import signal

    from tests.engines.conftest import create_pool
    from tierfs.local import LocalCluster

    a, _ = servers
    cl = LocalCluster(tmp_path_factory.mktemp("sglang-stall"), n_meta=1, n_storage=3,
                      extra_meta_args=["--heartbeat-timeout=600"])
    cl.up(timeout=120)
    try:
        meta = ",".join(cl.meta_addrs)
        create_pool(cl.meta_addrs, "stall", redundancy="ec:2+1", target_memory=16 << 20, target_disk=0)
        a.call("backend", "st", "page_first", extra("stall", meta=meta, timeout=1.0))
        toks = tokens(8, seed=23)
        keys = a.call("keys", "st", toks)[:8]
        filled = a.call("fill", "st", 8, 29)
        pid = cl.kill("storage-1", signal.SIGSTOP)
        try:
            got = a.call("set_v1", "st", keys, filled["indices"], timeout=200)
            counters = a.call("stats", "st")["counters"]
        finally:
            os.kill(pid, signal.SIGCONT)
        assert got == [False] * 8  # every page has a fragment on the stalled daemon
        assert counters["errors"] == 1, counters  # one page retried; before: 8
        assert counters["pages_failed"] == 8, counters
    finally:
        cl.stop()
