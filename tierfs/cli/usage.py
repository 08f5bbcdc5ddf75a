"""Space commands: ``tierfs du`` (sizes of trees) and ``tierfs df`` (capacity
and use per target, per node, for the file placement groups and per KV pool).
Each returns plain data; :mod:`tierfs.cli.main` prints it.

``du`` counts two sizes. ``bytes``: logical (the sum of file sizes, as
``ls`` shows them). ``stored``: what the fragments take on the targets with
the redundancy of each file's layout: ``replica:N`` stores every byte N
times; ``ec:K+M`` stores the data once (trimmed fragments) plus M parity
fragments per chunk, each ceil(chunk_size / K) long (shorter for a chunk
smaller than that). It is computed from size and layout alone, so a sparse
file's holes count as written and a degraded chunk's missing fragments as
present; fragment headers are not counted.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterator, Sequence
from typing import Any

from tierfs.chunk import parity_size
from tierfs.client import AsyncClient, FileStat
from tierfs.errors import NotFoundError, TierFSError, UnavailableError

__all__ = ["df", "du", "stored_bytes"]

_RED = re.compile(r"^ec:(\d+)\+(\d+)$|^replica:(\d+)$")


def stored_bytes(size: int, redundancy: str, chunk_size: int) -> int | None:
    """Bytes the fragments of a file of ``size`` take with this layout (see
    the module); None for a layout this does not know."""
    m = _RED.match(redundancy)
    if m is None or chunk_size <= 0:
        return None
    if m.group(3):
        return size * int(m.group(3))
    k, par = int(m.group(1)), int(m.group(2))
    full, tail = divmod(size, chunk_size)
    parity = full * parity_size(k, chunk_size, chunk_size) + (parity_size(k, chunk_size, tail) if tail else 0)
    return size + par * parity


async def _file_stored(client: AsyncClient, st: FileStat) -> int | None:
    if not st.redundancy:
        # A listing without layouts (a meta that predates them, or a directory
        # listed without search permission): one stat for this file.
        try:
            st = await client.stat(st.path)
        except UnavailableError:
            raise
        except TierFSError:
            return None
    return stored_bytes(st.size, st.redundancy, st.chunk_size)


async def _du_tree(client: AsyncClient, path: str, rows: list[dict[str, Any]], errors: list[dict[str, str]],
                   *, all_dirs: bool) -> dict[str, Any]:
    # An explicit stack, not recursion: a tree may be as deep as a 4096-byte
    # path allows (about 2000 levels), past Python's recursion limit (du of
    # a tree 1000 levels deep died with a RecursionError traceback).
    async def frame(p: str) -> tuple[dict[str, Any], Iterator[FileStat]]:
        row: dict[str, Any] = {"path": p, "bytes": 0, "stored": 0, "files": 0, "dirs": 0, "unknown": 0}
        try:
            kids = await client.ls(p, detail=True)
        except UnavailableError:
            raise
        except TierFSError as exc:
            errors.append({"path": p, "error": str(exc)})
            kids = []
        return row, iter(kids)

    stack = [await frame(path)]
    while True:
        row, kids = stack[-1]
        for k in kids:
            if k.is_dir:
                stack.append(await frame(k.path))
                break
            if k.is_file:
                row["bytes"] += k.size
                row["files"] += 1
                s = await _file_stored(client, k)
                if s is None:
                    row["unknown"] += 1
                else:
                    row["stored"] += s
        else:
            # Every entry of this directory done: post-order, as du(1).
            stack.pop()
            if all_dirs:
                rows.append(row)
            if not stack:
                return row
            up = stack[-1][0]
            for f in ("bytes", "stored", "files", "dirs", "unknown"):
                up[f] += row[f]
            up["dirs"] += 1


async def du(client: AsyncClient, paths: Sequence[str], *, summarize: bool = False) -> dict[str, Any]:
    """Sizes of the trees at ``paths``: one row per directory (post-order, as
    du(1)), or per path with ``summarize``. Each row: ``bytes`` (logical),
    ``stored`` (with redundancy, see the module), ``files``, ``dirs``,
    ``unknown`` (files whose layout this could not read: not in ``stored``).
    A directory that cannot be listed is in ``errors`` and counts as empty."""
    rows: list[dict[str, Any]] = []
    tops: list[dict[str, Any]] = []
    errors: list[dict[str, str]] = []
    for p in paths or ["/"]:
        p = posixpath.normpath("/" + p.lstrip("/"))
        try:
            st = await client.stat(p)
        except NotFoundError as exc:
            if len(paths) < 2:
                raise
            # Several paths: each on its own, as du(1) (until stop 44 one
            # missing path printed nothing for the others).
            errors.append({"path": p, "error": str(exc)})
            continue
        if st.is_dir:
            top = await _du_tree(client, p, rows, errors, all_dirs=not summarize)
        else:
            s = await _file_stored(client, st) if st.is_file else 0
            top = {"path": p, "bytes": st.size if st.is_file else 0, "stored": s or 0,
                   "files": int(st.is_file), "dirs": 0, "unknown": int(s is None)}
            rows.append(top)
        if summarize and st.is_dir:
            rows.append(top)
        tops.append(top)
    return {"rows": rows, "errors": errors, "paths": [t["path"] for t in tops],
            "total": {f: sum(t[f] for t in tops) for f in ("bytes", "stored", "files", "dirs", "unknown")}}


def _state(name: str, prefix: str) -> str:
    return name.removeprefix(prefix).lower()


async def df(meta: Sequence[str], *, timeout: float = 20.0) -> dict[str, Any]:
    """Capacity, use and free space of every target (with its node, host,
    rack and state), summed per node and for the cluster; the file placement
    groups by width; each KV pool's budget (per-target budgets times its
    targets) and what its targets report holding.

    ``capacity`` is the target file system's size minus the storage daemon's
    reserve, ``used`` the bytes of TierFS fragment files there, ``free``
    their difference: targets that share one file system each count it whole
    (and its other users' bytes are not seen here; the daemon's
    ``tierfs_target_free_bytes`` metric has the file system's own figure)."""
    from tierfs.cli.kv import pool_summaries
    from tierfs.meta import MetaClient
    from tierfs.proto.v1 import meta_pb2 as pb

    async with MetaClient(list(meta), deadline=timeout, attempt_timeout=min(timeout, 3.0)) as mc:
        cmap = await mc.get_cluster_map()
        kv = await mc.list_kv_pools()
    nodes = {n.node_id: n for n in cmap.nodes}
    targets: list[dict[str, Any]] = []
    for t in sorted(cmap.targets, key=lambda t: t.target_id):
        n = nodes.get(t.node_id)
        targets.append({
            "id": t.target_id, "node": t.node_id, "hostname": n.hostname if n else "",
            # ClusterNode.rack arrives with rack labels; older maps have none.
            "rack": getattr(n, "rack", "") if n else "",
            "node_state": _state(pb.NodeState.Name(n.state), "NODE_STATE_") if n else "unknown",
            "state": _state(pb.TargetState.Name(t.state), "TARGET_STATE_"), "path": t.path,
            "capacity": t.capacity, "used": t.used,
            # The last committed figure (a new leader not yet reported to).
            "used_unreported": t.used_unreported,
            # What its file system really has free (other data may share
            # it); capacity - used when the leader has no report of it.
            "free": min(t.free, max(0, t.capacity - t.used)) if t.free else max(0, t.capacity - t.used),
        })
    per_node: list[dict[str, Any]] = []
    for nid in sorted(nodes):
        mine = [t for t in targets if t["node"] == nid]
        n = nodes[nid]
        per_node.append({"id": nid, "hostname": n.hostname, "rack": getattr(n, "rack", ""),
                         "state": _state(pb.NodeState.Name(n.state), "NODE_STATE_"),
                         "targets": [t["id"] for t in mine],
                         **{f: sum(t[f] for t in mine) for f in ("capacity", "used", "free")}})
    widths: dict[int, int] = {}
    for g in cmap.groups:
        widths[g.width] = widths.get(g.width, 0) + 1
    pools = []
    for p in pool_summaries(kv):
        # Its members: a pool without groups has none, though every
        # target reports (zero) usage for it.
        n_t = len({t for g in p["groups"] for t in g})
        pools.append({
            "name": p["name"], "id": p["id"], "redundancy": p["redundancy"], "targets": n_t,
            "groups": len(p["groups"]),
            "memory_budget": p["target_memory"] * n_t, "disk_budget": p["target_disk"] * n_t,
            "memory_used": p["usage"]["memory_used"], "disk_used": p["usage"]["disk_used"],
            "objects": p["usage"]["objects"], "placement": p["placement"],
        })
    return {
        "targets": targets, "nodes": per_node,
        "total": {f: sum(t[f] for t in targets) for f in ("capacity", "used", "free")} | {"targets": len(targets)},
        "file_groups": {"groups": len(cmap.groups), "by_width": {str(w): c for w, c in sorted(widths.items())}},
        "kv_pools": pools,
    }
