"""The ``tierfs kv`` command group: KV pool definitions (``tierfs kv pool
create|ls|rm``) and the per-pool, per-target usage that ``tierfs status``
shows. The data commands (``put``, ``get``, ``stat``, ``rm``, ``stats``,
``replay``) hang off the same group (:func:`add_kv_data_commands`). Each
function returns plain data; :mod:`tierfs.cli.main` prints it."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from tierfs.cli.util import human_size, parse_size_arg, table

__all__ = [
    "USAGE_FIELDS",
    "add_commands",
    "execute",
    "pool_create",
    "pool_ls",
    "pool_rm",
    "pool_summaries",
    "render_pools",
]

#: Counters of one (pool, target) as the storage daemons report them
#: (KVTargetUsage), summed per pool.
USAGE_FIELDS = ("objects", "memory_used", "disk_used", "pinned", "hits", "misses", "evictions", "puts",
                "expired", "corrupt", "bytes_in", "bytes_out")


def _hit_ratio(u: dict[str, Any]) -> float | None:
    lookups = u["hits"] + u["misses"]
    return round(u["hits"] / lookups, 4) if lookups else None


def pool_summaries(reply: Any) -> list[dict[str, Any]]:
    """Plain data for each pool of a ``ListKVPoolsReply``: its definition,
    its placement, its usage summed and per target. Targets are the pool's
    group members and any target that reported usage; one with no report
    reads as zeros."""
    by_pool: dict[int, dict[int, Any]] = {}
    for u in reply.usage:
        by_pool.setdefault(u.pool_id, {})[u.target_id] = u
    out = []
    for p in reply.pools:
        reported = by_pool.get(p.pool_id, {})
        tids = sorted({t for g in p.groups for t in g.target_ids} | set(reported))
        targets = []
        for t in tids:
            u = reported.get(t)
            row: dict[str, Any] = {"id": t, "reported": u is not None}
            row.update({f: int(getattr(u, f)) if u is not None else 0 for f in USAGE_FIELDS})
            row["hit_ratio"] = _hit_ratio(row)
            targets.append(row)
        total: dict[str, Any] = {f: sum(t[f] for t in targets) for f in USAGE_FIELDS}
        total["hit_ratio"] = _hit_ratio(total)
        out.append({
            "id": p.pool_id, "name": p.name, "redundancy": p.redundancy, "width": p.width,
            "target_memory": p.target_memory, "target_disk": p.target_disk, "fsync": p.fsync,
            "pin_quota": p.pin_quota, "policy": p.policy, "tenant": p.tenant or "user", "created_ns": p.created_ns,
            "groups": [list(g.target_ids) for g in p.groups],
            # A pool without groups takes no objects: too few storage nodes.
            "placement": "ok" if p.groups else
                         f"no placement groups: needs {p.width} storage nodes with an online target",
            "usage": total, "targets": targets,
        })
    return out


async def pool_create(meta: Sequence[str], name: str, *, redundancy: str = "replica:1", target_memory: int = 0,
                      target_disk: int = 0, fsync: bool = False, pin_quota: int = 0, policy: str = "",
                      tenant: str = "", timeout: float = 20.0) -> dict[str, Any]:
    """Define a KV pool; returns it as :func:`pool_summaries` describes pools."""
    from tierfs.meta import MetaClient
    from tierfs.proto.v1 import meta_pb2 as pb

    async with MetaClient(list(meta), deadline=timeout) as mc:
        pool = await mc.create_kv_pool(name, redundancy=redundancy, target_memory=target_memory,
                                       target_disk=target_disk, fsync=fsync, pin_quota=pin_quota, policy=policy,
                                       tenant=tenant)
    return pool_summaries(pb.ListKVPoolsReply(pools=[pool]))[0]


async def pool_ls(meta: Sequence[str], *, timeout: float = 20.0) -> list[dict[str, Any]]:
    from tierfs.meta import MetaClient

    async with MetaClient(list(meta), deadline=timeout) as mc:
        return pool_summaries(await mc.list_kv_pools())


async def pool_rm(meta: Sequence[str], name: str, *, timeout: float = 20.0) -> dict[str, Any]:
    from tierfs.meta import MetaClient

    async with MetaClient(list(meta), deadline=timeout) as mc:
        await mc.remove_kv_pool(name)
    return {"name": name, "removed": True}


def _pct(x: float | None) -> str | None:
    return None if x is None else f"{100 * x:.1f}%"


def render_pools(pools: list[dict[str, Any]], *, per_target: bool = False) -> str:
    """The KV pool table (``tierfs kv pool ls``; with ``per_target``, one
    row per target under each pool, as ``tierfs status`` shows)."""
    if not pools:
        return "KV pools: none (`tierfs kv pool create NAME ...`)"
    rows = []
    for p in pools:
        u = p["usage"]
        rows.append([p["name"], p["id"], p["redundancy"], len(p["groups"]) or "none",
                     human_size(p["target_memory"]), human_size(p["target_disk"]), p["policy"],
                     u["objects"], human_size(u["memory_used"]), human_size(u["disk_used"]), _pct(u["hit_ratio"])])
        if per_target:
            for t in p["targets"]:
                rows.append([f"  target {t['id']}", "", "", "", "", "", "", t["objects"],
                             human_size(t["memory_used"]), human_size(t["disk_used"]), _pct(t["hit_ratio"])])
    out = [table(rows, ["KV POOL", "ID", "REDUNDANCY", "GROUPS", "MEM/TARGET", "DISK/TARGET", "POLICY",
                         "OBJECTS", "MEM USED", "DISK USED", "HITS"])]
    out += [f"  pool {p['name']}: {p['placement']}" for p in pools if p["placement"] != "ok"]
    return "\n".join(out)


# ---- the command line ------------------------------------------------------------------


def add_commands(cmd: Callable[..., argparse.ArgumentParser],
                 common: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register the ``kv`` group on the ``tierfs`` parser. ``cmd(name,
    help)`` makes a top-level sub-command; ``common(parser)`` adds the
    cluster options (--meta, --json, ...) to a nested one."""
    p = cmd("kv", "the KV-cache store: pools (and the data commands)")
    sub = p.add_subparsers(dest="kv_cmd", metavar="KVCOMMAND", required=True)
    pool = sub.add_parser("pool", help="KV pool definitions: create, ls, rm",
                          description="KV pool definitions: create, ls, rm")
    common(pool)
    psub = pool.add_subparsers(dest="pool_cmd", metavar="ACTION", required=True)
    c = psub.add_parser("create", help="define a KV pool", description="define a KV pool")
    common(c)
    c.add_argument("name", help="1 to 64 characters of A-Z a-z 0-9 _ . -")
    c.add_argument("--redundancy", default="replica:1", help="replica:N or ec:K+M (default replica:1)")
    c.add_argument("--target-memory", type=parse_size_arg, default=0, metavar="SIZE",
                   help="memory budget per target, e.g. 256MiB (0: disk only)")
    c.add_argument("--target-disk", type=parse_size_arg, default=0, metavar="SIZE",
                   help="disk budget per target, e.g. 1GiB (0: memory only, lost on restart)")
    c.add_argument("--fsync", action="store_true", help="fsync each put before acknowledging it")
    c.add_argument("--pin-quota", type=parse_size_arg, default=0, metavar="SIZE",
                   help="hard-pinned bytes allowed per target (default 0)")
    c.add_argument("--policy", default="", metavar="NAME",
                   help="eviction policy: lru (the default), leaf-lru, s3fifo, arc or chain (docs/kv_policies.md)")
    c.add_argument("--tenant", default="", choices=["user", "group"],
                   help="whose key namespace a caller uses: its uid (user, default) or its gid (group)")
    c = psub.add_parser("ls", help="list KV pools with their usage", description="list KV pools with their usage")
    common(c)
    c.add_argument("-l", dest="long", action="store_true", help="one row per target under each pool")
    c = psub.add_parser("rm", help="remove a KV pool (its objects are dropped)",
                        description="remove a KV pool (its objects are dropped)")
    common(c)
    c.add_argument("name")
    def data_cmd(name: str, help: str) -> argparse.ArgumentParser:
        q: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
        common(q)
        return q

    from tierfs.cli.kvdata import add_kv_data_commands

    add_kv_data_commands(data_cmd)


def execute(ns: argparse.Namespace, meta: Sequence[str], emit: Callable[[Any, str | None], None],
            run: Callable[[Any], Any], *, out: Any = None) -> int | None:
    """Run ``ns`` if it is one of this module's commands; its exit code (None: not ours)."""
    if ns.cmd != "kv":
        return None
    if ns.kv_cmd == "pool":
        if ns.pool_cmd == "create":
            r = run(pool_create(meta, ns.name, redundancy=ns.redundancy, target_memory=ns.target_memory,
                                target_disk=ns.target_disk, fsync=ns.fsync, pin_quota=ns.pin_quota,
                                policy=ns.policy, tenant=ns.tenant, timeout=ns.timeout))
            placed = (f"{len(r['groups'])} placement groups)" if r["placement"] == "ok"
                      else f"{r['placement']}; it takes objects once they join)")
            emit(r, f"KV pool {r['name']!r} created (id {r['id']}, {r['redundancy']}, {placed}")
            return 0
        if ns.pool_cmd == "ls":
            pools = run(pool_ls(meta, timeout=ns.timeout))
            emit(pools, render_pools(pools, per_target=ns.long))
            return 0
        if ns.pool_cmd == "rm":
            emit(run(pool_rm(meta, ns.name, timeout=ns.timeout)), f"KV pool {ns.name!r} removed")
            return 0
    from tierfs.cli.kvdata import execute_kv_data

    return execute_kv_data(ns, meta, emit, run, out)
