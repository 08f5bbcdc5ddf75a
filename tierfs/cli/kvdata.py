"""``tierfs kv put/get/stat/rm/stats/replay``: KV objects from the command line.

Each function returns plain data; :mod:`tierfs.cli.main` prints it
(``--json`` or text). The pool commands (``tierfs kv pool ...``) live in
:mod:`tierfs.cli.kv`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from tierfs.cli.util import human_rate, human_size, parse_seconds
from tierfs.errors import InvalidArgumentError, NotFoundError

__all__ = ["add_kv_data_commands", "execute_kv_data"]


def add_kv_data_commands(cmd: Callable[..., argparse.ArgumentParser]) -> None:
    """Register the object commands on the ``kv`` sub-parser (``cmd(name, help)``)."""
    p = cmd("put", "store a local file (- for stdin) as a KV object")
    p.add_argument("key")
    p.add_argument("local")
    p.add_argument("--pool", default="default")
    p.add_argument("--overwrite", action="store_true", help="replace an existing object")
    p.add_argument("--ttl", type=parse_seconds, default=None, metavar="SECONDS", help="expire after this long")
    p.add_argument("--pin", choices=["soft", "hard"], default=None, help="keep it from eviction")
    p = cmd("get", "write a KV object to a local file (- or nothing for stdout)")
    p.add_argument("key")
    p.add_argument("local", nargs="?", default="-")
    p.add_argument("--pool", default="default")
    p = cmd("stat", "whether a KV object is there, its size and the targets holding it")
    p.add_argument("key")
    p.add_argument("--pool", default="default")
    p = cmd("rm", "delete a KV object")
    p.add_argument("key")
    p.add_argument("--pool", default="default")
    p = cmd("stats", "KV usage per pool and per target, and hit/miss/eviction counters")
    p.add_argument("--pool", default=None, help="only this pool")
    p = cmd("replay", "replay a KV-reuse trace (Mooncake JSONL format) through the tiers")
    p.add_argument("trace")
    p.add_argument("--simulate", action="store_true", help="run the policies without I/O (any capacity)")
    p.add_argument("--dram", default="0", metavar="N|N%", help="DRAM-tier capacity in blocks or %% of unique blocks")
    p.add_argument("--ssd", default="0", metavar="N|N%", help="local-SSD tier capacity")
    p.add_argument("--cluster", default="0", metavar="N|N%",
                   help="cluster tier capacity (simulate; live: a temporary pool sized to it, 0 = the pool as is)")
    p.add_argument("--policy", default="lru",
                   help="eviction policy (every tier), or TIER=NAME,... (a tier left out: lru)")
    p.add_argument("--block-size", default="64KiB", help="bytes per block (live replay)")
    p.add_argument("--pool", default="default", help="live replay: the pool to use when --cluster is 0")
    p.add_argument("--ssd-path", default="", help="live replay: file of the SSD tier (default: a temporary file)")
    p.add_argument("--limit", type=int, default=0, metavar="N", help="only the first N requests (0: all)")
    p.add_argument("--prefill-tokens-per-s", type=_rate, default=0.0,
                   help="prefill throughput, to report the prefill time the hits saved")
    p.add_argument("--load-gbps", type=_rate, default=0.0,
                   help="load bandwidth (GB/s) to report the load time (simulate; live replay measures it)")
    p.add_argument("--tokens-per-block", type=_count, default=512,
                   help="tokens a hit block saves (at most its request's input_length)")


def _rate(value: str) -> float:
    """A finite rate >= 0 (argparse type; 0: not given). NaN and infinity
    made the report's load time and latencies nan or 0."""
    import math

    try:
        v = float(value)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {value!r}")
    return v


def _count(value: str) -> int:
    """A whole number >= 0 (argparse type): a negative --tokens-per-block
    reported negative hit tokens and prefill time saved."""
    try:
        v = int(value)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, not {value!r}")
    return v


def _read_local(path: str, limit: int, pool: str) -> bytes:
    """The whole of ``path`` (``-``: stdin), at most ``limit`` bytes: a
    longer one (``/dev/zero``, an endless pipe) is refused after reading
    ``limit + 1`` bytes instead of filling memory."""
    from tierfs.cli.fs import LocalFileError

    try:
        if path == "-":
            data = sys.stdin.buffer.read(limit + 1)
        else:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
    except OSError as exc:
        raise LocalFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise LocalFileError(f"{path} holds more than {limit} bytes, more than a KV object of pool {pool!r} "
                             f"can be (store large files with `tierfs put`)")
    return data


async def kv_put(client: Any, key: str, local: str, *, pool: str = "default", overwrite: bool = False,
                 ttl: float | None = None, pin: str | None = None) -> dict[str, Any]:
    data = _read_local(local, await client.kv_pool(pool).cluster.max_object_bytes(), pool)
    t0 = time.perf_counter()
    stored = await client.kv_pool(pool).put(key, data, overwrite=overwrite, ttl=ttl, pin=pin)
    return {"pool": pool, "key": key, "bytes": len(data), "stored": stored,
            "seconds": time.perf_counter() - t0}


async def kv_get(client: Any, key: str, local: str, out: IO[bytes], *, pool: str = "default") -> dict[str, Any]:
    t0 = time.perf_counter()
    data = await client.kv_pool(pool).get(key)
    if data is None:
        raise NotFoundError(f"no KV object {key!r} in pool {pool!r}")
    if local == "-":
        out.write(data)
        out.flush()
    else:
        try:
            with open(local, "wb") as f:
                f.write(data)
        except OSError as exc:
            from tierfs.cli.fs import LocalFileError

            raise LocalFileError(f"cannot write {local}: {exc.strerror or exc}") from None
    return {"pool": pool, "key": key, "bytes": len(data), "local": local, "seconds": time.perf_counter() - t0}


async def kv_stat(client: Any, key: str, *, pool: str = "default") -> dict[str, Any]:
    from tierfs.kv.cluster import group_of, placement
    from tierfs.kv.keys import normalize_key

    h = client.kv_pool(pool)
    k = normalize_key(key)
    route = await h.cluster.route()
    if not route.groups:
        raise InvalidArgumentError(f"KV pool {pool!r} has no placement groups yet")
    gi = group_of(k, len(route.groups))
    targets, stamps = placement(route, k)
    holders = []
    for t, stamp in zip(targets, stamps, strict=True):
        try:
            if (await h.cluster.data.kv_exists(t, route.pool_id, [k], timeout=h.cluster.timeout, since=stamp))[0]:
                holders.append(t)
        except Exception:
            pass
    size = ttl_left = None
    if holders:
        expiries: list[float] = []
        size = await h.cluster.size_of(k, expiries)  # the size alone: the value does not travel
        if size is not None and expiries[0]:
            ttl_left = round(max(0.0, expiries[0] - time.monotonic()), 3)
    return {"pool": pool, "key": key, "present": bool(holders), "size": size, "group": gi,
            "targets": list(targets), "held_by": holders, "redundancy": route.redundancy,
            "ttl_left_s": ttl_left}


async def kv_rm(client: Any, key: str, *, pool: str = "default") -> dict[str, Any]:
    existed = await client.kv_pool(pool).delete(key)
    if not existed:
        raise NotFoundError(f"no KV object {key!r} in pool {pool!r}")
    return {"pool": pool, "key": key, "deleted": True}


async def kv_stats(meta: Sequence[str], *, pool: str | None = None, timeout: float = 20.0) -> dict[str, Any]:
    """Per-pool, per-target usage and counters as the daemons last reported them."""
    from tierfs.cli.kv import pool_ls
    from tierfs.meta import MetaClient
    from tierfs.proto.v1 import meta_pb2 as pb

    pools = await pool_ls(meta, timeout=timeout)
    if pool is not None:
        pools = [p for p in pools if p["name"] == pool]
        if not pools:
            raise NotFoundError(f"unknown KV pool {pool!r}")
    # Each target's state: a target that is not online shows what it said
    # last, marked as such (it read as current).
    async with MetaClient(list(meta), deadline=timeout, attempt_timeout=min(timeout, 3.0)) as mc:
        cmap = await mc.get_cluster_map()
    states = {t.target_id: pb.TargetState.Name(t.state).removeprefix("TARGET_STATE_").lower() for t in cmap.targets}
    for p in pools:
        for t in p.get("targets", []):
            t["state"] = states.get(t["id"], "removed")
    return {"pools": pools}


def render_stats(r: dict[str, Any]) -> str:
    lines = []
    for p in r.get("pools", []):
        u = p["usage"]
        lines.append(f"pool {p['name']} ({p['redundancy']}): {u['objects']} objects, "
                     f"{human_size(u['memory_used'])} in memory, {human_size(u['disk_used'])} on disk; "
                     f"puts {u['puts']}, hits {u['hits']}, misses {u['misses']}, evictions {u['evictions']}")
        for t in p.get("targets", []):
            state = t.get("state", "online")
            mark = f" ({state}: its last report)" if state in ("offline", "failed", "removed") else ""
            lines.append(f"  target {t['id']}{mark}: {t['objects']} objects, {human_size(t['memory_used'])} mem, "
                         f"{human_size(t['disk_used'])} disk, hits {t['hits']}, misses {t['misses']}, "
                         f"evictions {t['evictions']}")
    if lines:
        # Meta knows what the daemons said in their last heartbeats (every
        # second by default): a put made just now may not show yet.
        lines.append("(as the storage daemons last reported at their heartbeats: a few seconds behind at most)")
    return "\n".join(lines) or "no KV pools"


def execute_kv_data(ns: argparse.Namespace, meta: Sequence[str], emit: Callable[[Any, str | None], None],
                    run: Callable[[Any], Any], out: Any) -> int | None:
    """Run ``tierfs kv ACTION`` if it is an object command; its exit code (None: not ours)."""
    a = getattr(ns, "kv_cmd", None)

    def client_call(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        from tierfs.client import AsyncClient

        async def go() -> Any:
            async with AsyncClient(list(meta), meta_deadline=ns.timeout,
                                   meta_attempt_timeout=min(3.0, ns.timeout)) as client:
                return await fn(client, *args, **kw)

        return run(go())

    if a == "put":
        r = client_call(kv_put, ns.key, ns.local, pool=ns.pool, overwrite=ns.overwrite, ttl=ns.ttl, pin=ns.pin)
        # Not "N B already there": N is what was given, not what is kept.
        emit(r, f"{ns.key}: {human_size(r['bytes'])} stored in pool {ns.pool} "
                f"({human_rate(r['bytes'], r['seconds'])})" if r["stored"] else
             f"{ns.key}: already there in pool {ns.pool}, kept (the {human_size(r['bytes'])} given were not "
             f"stored; --overwrite replaces it)")
        return 0
    if a == "get":
        stream: IO[bytes] = out.buffer if out is not None and hasattr(out, "buffer") else sys.stdout.buffer
        r = client_call(kv_get, ns.key, ns.local, stream, pool=ns.pool)
        if ns.local != "-":
            emit(r, f"{ns.key} -> {ns.local}: {human_size(r['bytes'])}")
        return 0
    if a == "stat":
        r = client_call(kv_stat, ns.key, pool=ns.pool)
        expires = "" if r["ttl_left_s"] is None else f", expires in {r['ttl_left_s']:.1f} s"
        emit(r, (f"{ns.key}: {human_size(r['size'] or 0)} in pool {ns.pool} ({r['redundancy']}), group {r['group']}, "
                 f"on targets {r['held_by']} of {r['targets']}{expires}") if r["present"]
             else f"{ns.key}: not in pool {ns.pool} (would live on targets {r['targets']})")
        return 0 if r["present"] else 1
    if a == "rm":
        emit(client_call(kv_rm, ns.key, pool=ns.pool), f"{ns.key}: deleted from pool {ns.pool}")
        return 0
    if a == "stats":
        r = run(kv_stats(meta, pool=ns.pool, timeout=ns.timeout))
        emit(r, render_stats(r))
        return 0
    if a == "replay":
        from tierfs.kv.replay import render_replay, replay_cli

        r = replay_cli(ns, lambda: meta, run)
        emit(r, render_replay(r))
        return 0
    return None
