"""``tierfs kv replay``: a KV-reuse trace (Mooncake format) replayed against a
live cluster through the real tiers, or simulated (:func:`tierfs.kv.trace.simulate`).

Live, per request (as an engine would): ``batch_exists`` of the request's
block keys gives the prefix hit; the hit blocks are loaded with
``batch_get_into`` (timed: the load latency) and checked byte for byte
against what was stored; then the blocks after the hit are stored with
``batch_put``, as prefill would. Which tier served each hit block comes from
the tiers' own hit counters. Each block is ``--block-size`` bytes whose
content is derived from its hash id and the run, so a wrong byte is caught.

Keys are namespaced by a random run id, so runs do not hit each other's
objects. With ``--cluster N`` the run gets its own temporary pool sized to
about N blocks (memory only, ``replica:1``), removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tierfs.cli.util import parse_size_arg
from tierfs.errors import (
    AlreadyExistsError,
    CorruptError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from tierfs.kv.trace import (
    BLOCK_TOKENS,
    Request,
    hit_tokens_of,
    load_trace,
    prefill_accounting,
    resolve_capacity,
    simulate,
    unique_blocks,
)
from tierfs.meta.ops import MIN_KV_BUDGET

__all__ = ["live_replay", "parse_policy", "render_replay", "replay_cli"]


def parse_policy(spec: str) -> str | dict[str, str]:
    """``lru`` (every tier) or ``dram=lru,ssd=NAME,cluster=NAME``."""
    if "=" not in spec:
        return spec
    out: dict[str, str] = {}
    for part in spec.split(","):
        tier, sep, name = part.partition("=")
        if not sep or not tier.strip() or not name.strip():
            raise InvalidArgumentError(f"bad --policy part {part!r} (want TIER=NAME)")
        out[tier.strip()] = name.strip()
    return out


def _percentiles(vals: list[float]) -> dict[str, float]:
    if not vals:
        return {"p50": 0.0, "p99": 0.0, "mean": 0.0}
    a = np.asarray(vals)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "mean": float(a.mean())}


def _fill(buf: np.ndarray, hash_id: int, run: int) -> None:
    buf.fill((hash_id * 0x9E3779B97F4A7C15 ^ run) & 0xFFFFFFFFFFFFFFFF)


async def live_replay(meta: Sequence[str], trace: Sequence[Request], *, dram: int, ssd: int, cluster: int,
                      policy: str | dict[str, str], block_size: int, pool: str = "default", ssd_path: str = "",
                      prefill_tokens_per_s: float = 0.0, tokens_per_block: int = BLOCK_TOKENS,
                      progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Replay ``trace`` through a client with the given tier capacities (in blocks)."""
    from tierfs.client import AsyncClient
    from tierfs.meta import MetaClient

    if block_size < 8 or block_size % 8:
        raise InvalidArgumentError(f"--block-size must be a positive multiple of 8 bytes, got {block_size}")
    pol = policy if isinstance(policy, str) else None
    pols = policy if isinstance(policy, dict) else {}
    run = int.from_bytes(os.urandom(8), "little")
    tag = f"{run & 0xFFFFFFFF:08x}"
    tmp: tempfile.TemporaryDirectory[str] | None = None
    if ssd and not ssd_path:
        tmp = tempfile.TemporaryDirectory(prefix="tierfs-replay-")
        ssd_path = os.path.join(tmp.name, "ssd.tier")
    created_pool = ""
    try:
        if cluster:
            async with MetaClient(list(meta)) as mc:
                cmap = await mc.get_cluster_map()
                n_targets = max(1, sum(1 for _ in cmap.targets))
                # replica:1 spreads keys over every target; headroom for the watermark and the hash's spread
                per_target = int(cluster * block_size / n_targets / 0.85) + block_size
                # at least meta's smallest budget (a small --cluster was refused
                # naming target_memory, a setting the user never gave, until stop 47)
                per_target = max(per_target, MIN_KV_BUDGET)
                name = f"replay-{tag}"
                # Named before the call: a stop (SIGTERM, Ctrl-C) while the
                # call was in flight left a pool meta had made (a flaky
                # test, stop 48). Removing one that was refused (a bad
                # policy) finds none, and the refusal's own reason stands.
                created_pool = name
                try:
                    await mc.create_kv_pool(name, redundancy="replica:1", target_memory=per_target,
                                            target_disk=0, policy=pols.get("cluster", pol or "lru"))
                except PermissionDeniedError as exc:
                    # Refused: meta made no pool. Trying to remove it would
                    # answer for the refusal (a user's --cluster said
                    # "RemoveKVPool is an admin operation" until stop 48).
                    created_pool = ""
                    raise PermissionDeniedError(
                        f"{exc} (--cluster makes a temporary KV pool, which needs an admin token; without "
                        f"--cluster the replay uses an existing pool, --pool)") from None
                except (UnauthenticatedError, InvalidArgumentError, AlreadyExistsError):
                    created_pool = ""
                    raise
            pool = created_pool
        opts: dict[str, Any] = {"kv_pool": pool}
        if dram:
            opts.update(kv_dram_bytes=dram * block_size, kv_dram_policy=pols.get("dram", pol or "lru"))
        if ssd:
            opts.update(kv_ssd_bytes=ssd * block_size, kv_ssd_path=ssd_path, kv_ssd_policy=pols.get("ssd", pol or "lru"))
        async with AsyncClient(list(meta), **opts) as client:
            kv = client.kv
            for _ in range(100):  # a new pool reaches the map (and the daemons) within a heartbeat or two
                try:
                    await kv.cluster.route()
                    break
                except Exception:
                    await asyncio.sleep(0.2)
            return await _run(kv, trace, run, tag, block_size, prefill_tokens_per_s, tokens_per_block,
                              policy, dram, ssd, cluster, progress)
    finally:
        if created_pool:
            async with MetaClient(list(meta)) as mc:
                with contextlib.suppress(NotFoundError):
                    await mc.remove_kv_pool(created_pool)
        if tmp is not None:
            tmp.cleanup()


async def _run(kv: Any, trace: Sequence[Request], run: int, tag: str, block_size: int,
               prefill_tokens_per_s: float, tokens_per_block: int, policy: Any, dram: int, ssd: int,
               cluster: int, progress: Callable[[int, int], None] | None) -> dict[str, Any]:
    words = block_size // 8
    max_blocks = max((len(r.hash_ids) for r in trace), default=0)
    bufs = [np.empty(words, dtype=np.uint64) for _ in range(max_blocks)]
    want = np.empty(words, dtype=np.uint64)
    prefix = f"replay:{tag}:".encode()
    served = {"dram": 0, "ssd": 0, "cluster": 0}
    blocks = hit_blocks = hit_tokens = 0
    lat: list[float] = []
    bytes_loaded = 0
    lost_after_exists = 0

    def tier_hits() -> dict[str, int]:
        st = kv.stats()
        out = {"cluster": int(st["cluster"]["hits"])}
        for t in st["tiers"]:
            out[t["name"]] = int(t["hits"])
        return out

    t_start = time.perf_counter()
    for n, req in enumerate(trace):
        keys = [prefix + b"%d" % h for h in req.hash_ids]
        blocks += len(keys)
        hit = await kv.batch_exists(keys) if keys else 0
        if hit:
            before = tier_hits()
            t0 = time.perf_counter()
            got = await kv.batch_get_into(keys[:hit], bufs[:hit])
            lat.append((time.perf_counter() - t0) * 1000)
            after = tier_hits()
            loaded = 0
            for i, g in enumerate(got):
                if g is None:
                    lost_after_exists += 1  # evicted between exists and get: the prefix ends here
                    break
                if g != block_size:
                    raise CorruptError(f"block {req.hash_ids[i]} came back with {g} bytes, not {block_size}")
                _fill(want, req.hash_ids[i], run)
                if not np.array_equal(bufs[i], want):
                    raise CorruptError(f"block {req.hash_ids[i]} came back with wrong bytes")
                loaded += 1
            for name in served:
                served[name] += after.get(name, 0) - before.get(name, 0)
            hit = loaded
            hit_blocks += loaded
            hit_tokens += hit_tokens_of(loaded, req.input_length, tokens_per_block)
            bytes_loaded += loaded * block_size
        if hit < len(keys):
            new = keys[hit:]
            for i, h in enumerate(req.hash_ids[hit:]):
                _fill(bufs[i], h, run)
            await kv.batch_put(new, bufs[:len(new)])
        if progress is not None:
            progress(n + 1, len(trace))
    await kv.flush()
    wall = time.perf_counter() - t_start
    total = max(blocks, 1)
    # The tiers' counters count every block fetched, promotion re-reads aside;
    # scale so the per-tier ratios add up to the measured prefix hits.
    s = sum(served.values())
    scale = hit_blocks / s if s else 0.0
    ratio = {k: v * scale / total for k, v in served.items()}
    ratio["total"] = hit_blocks / total
    out: dict[str, Any] = {
        "mode": "live", "requests": len(trace), "blocks": blocks, "hit_blocks": hit_blocks,
        "hit_ratio": ratio, "policy": policy, "capacities": {"dram": dram, "ssd": ssd, "cluster": cluster},
        "block_size": block_size, "bytes_loaded": bytes_loaded, "load_latency_ms": _percentiles(lat),
        "load_gbps": bytes_loaded / 1e9 / (sum(lat) / 1000) if lat else 0.0, "seconds": wall,
        "lost_between_exists_and_get": lost_after_exists, "stats": kv.stats(),
    }
    if prefill_tokens_per_s > 0 and out["load_gbps"] > 0:
        out["prefill"] = prefill_accounting(hit_tokens, bytes_loaded,
                                            prefill_tokens_per_s=prefill_tokens_per_s, load_gbps=out["load_gbps"])
    return out


def replay_cli(ns: argparse.Namespace, meta: Callable[[], Sequence[str]], run: Callable[[Any], Any]) -> dict[str, Any]:
    trace = load_trace(ns.trace)
    if ns.limit < 0:
        raise InvalidArgumentError(f"--limit {ns.limit}: give a number of requests (0: all of them)")
    if ns.limit:
        trace = trace[: ns.limit]
    policy = parse_policy(ns.policy)
    if ns.simulate:
        r = simulate(trace, {"dram": ns.dram, "ssd": ns.ssd, "cluster": ns.cluster}, policy,
                     block_bytes=parse_size_arg(ns.block_size),
                     prefill_tokens_per_s=ns.prefill_tokens_per_s or None, load_gbps=ns.load_gbps or None,
                     tokens_per_block=ns.tokens_per_block)
        r["mode"] = "simulate"
        return r
    unique = unique_blocks(trace)
    caps = {t: resolve_capacity(getattr(ns, t), unique) for t in ("dram", "ssd", "cluster")}
    # SIGTERM (timeout(1), a job scheduler) stops the replay as Ctrl-C does,
    # so that its temporary pool and SSD file are removed (they were left
    # behind until stop 47).
    old = signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        return run(live_replay(meta(), trace, dram=caps["dram"], ssd=caps["ssd"],  # type: ignore[no-any-return]
                               cluster=caps["cluster"], policy=policy, block_size=parse_size_arg(ns.block_size),
                               pool=ns.pool, ssd_path=ns.ssd_path, prefill_tokens_per_s=ns.prefill_tokens_per_s,
                               tokens_per_block=ns.tokens_per_block))
    finally:
        signal.signal(signal.SIGTERM, old)


def render_replay(r: dict[str, Any]) -> str:
    h = r["hit_ratio"]
    lines = [f"{r.get('mode', '')} replay: {r['requests']} requests, {r['blocks']} blocks, policy {r['policy']}",
             "hit ratio: " + ", ".join(f"{k} {v:.3f}" for k, v in h.items())]
    if r.get("load_latency_ms"):
        ll = r["load_latency_ms"]
        lines.append(f"load latency: p50 {ll.get('p50', 0):.2f} ms, p99 {ll.get('p99', 0):.2f} ms; "
                     f"{r.get('bytes_loaded', 0) / 1e6:.1f} MB loaded")
    if r.get("prefill"):
        p = r["prefill"]
        lines.append(f"prefill saved {p['prefill_saved_s']:.1f} s, load spent {p['load_s']:.1f} s")
    return "\n".join(lines)
