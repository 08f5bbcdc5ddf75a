"""Failure-handling commands: ``tierfs target rm``, ``tierfs node drain``,
``tierfs node rm``, ``tierfs scrub``, and the rebuild progress that
``tierfs status`` shows. Each function returns plain data;
:mod:`tierfs.cli.main` prints it (``--json`` or tables)."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from tierfs.cli.util import human_size
from tierfs.errors import TierFSError, UnavailableError, from_grpc

__all__ = [
    "add_commands",
    "drain_node",
    "rebuild_progress",
    "remove_node",
    "remove_target",
    "render_scrub",
    "repair_failures",
    "scrub_cluster",
    "undrain_node",
]


async def remove_target(meta: Sequence[str], target_id: int, *, timeout: float = 20.0,
                        force: bool = False) -> dict[str, Any]:
    """Declare a target dead: meta replaces it in every group at once and the
    replacements rebuild its fragments from the survivors. Refused while the
    target is online and the last readable copy of some group, unless ``force``."""
    from tierfs.meta import MetaClient

    async with MetaClient(list(meta), deadline=timeout) as mc:
        cmap = await mc.get_cluster_map()
        groups = sum(1 for g in cmap.groups if target_id in g.target_ids)
        reply = await mc.remove_target(target_id, force=force)
    return {"target": target_id, "groups": groups, "groups_stuck": list(reply.groups_stuck)}


async def drain_node(meta: Sequence[str], node_id: int, *, wait: bool = False, timeout: float = 20.0,
                     progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Move every fragment off a healthy node (its targets are replaced in
    every group, the new members copy from it). With ``wait``, return once
    no group is still rebuilding from it (or raise UnavailableError after
    ``timeout``): done, or with groups it still holds because no target
    could replace it there (``groups_stuck``; waiting would not move them:
    until stop 44 ``--wait`` waited out its whole timeout for them).
    ``progress`` gets, every poll while waiting, the groups copying, the
    fragments and bytes the new members report, and the copy targets that
    are down (such a copy waits for meta to replace its destination)."""
    from tierfs.meta import MetaClient

    async with MetaClient(list(meta), deadline=min(timeout, 20.0)) as mc:
        reply = await mc.drain_node(node_id)
        out: dict[str, Any] = {"node": node_id, "groups_stuck": list(reply.groups_stuck), "done": False}
        cmap = await mc.get_cluster_map()
        mine = {t for n in cmap.nodes if n.node_id == node_id for t in n.target_ids}
        start = time.monotonic()
        end = start + timeout
        while True:
            held = [g.group_id for g in cmap.groups if mine.intersection(g.target_ids)]
            feeding = [g.group_id for g in cmap.groups if mine.intersection(g.rebuild_sources)]
            out.update(groups_held=held, groups_copying=feeding, done=not held and not feeding)
            if out["done"] or not wait:
                return out
            if not feeding:
                # Nothing copies from it, yet it holds these: no replacement.
                out["groups_stuck"] = sorted(set(out["groups_stuck"]) | set(held))
                return out
            if progress is not None:
                progress(await _drain_progress(cmap, feeding, time.monotonic() - start))
            if time.monotonic() > end:
                raise UnavailableError(f"node {node_id} still feeds rebuilds of groups {feeding}"
                                       + (f" and holds {held}" if held else "") + f" after {timeout:.0f}s")
            await asyncio.sleep(0.5)
            cmap = await mc.get_cluster_map()


async def _drain_progress(cmap: Any, feeding: list[int], seconds: float) -> dict[str, Any]:
    """What ``drain_node`` reports while it waits: see there."""
    from tierfs.proto.v1 import meta_pb2 as pb

    state = {t.target_id: t.state for t in cmap.targets}
    copying = set(feeding)
    down = sorted({t for g in cmap.groups if g.group_id in copying for t in g.rebuilding
                   if state.get(t) not in (pb.TARGET_STATE_ONLINE, pb.TARGET_STATE_READ_ONLY)})
    rebuilds = await rebuild_progress(cmap, timeout=2.0)
    mine = [p for g, p in rebuilds.items() if g in copying]
    return {"groups_copying": len(feeding), "fragments_done": sum(p["done"] for p in mine),
            "fragments_total": sum(p["total"] for p in mine), "bytes": sum(p["bytes"] for p in mine),
            "destinations_down": down, "seconds": seconds}


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def drain_line(node_id: int, p: dict[str, Any]) -> str:
    """One progress line of ``tierfs node drain --wait``."""
    frags = (f", {p['fragments_done']:,}/{p['fragments_total']:,} fragments ({human_size(p['bytes'])}) copied"
             if p["fragments_total"] else "")
    down = (f"; copy target(s) {', '.join(map(str, p['destinations_down']))} down: meta replaces them after "
            f"its replace_after where another target can take their place (the copy then starts again), "
            f"else the copy goes on when they are back" if p["destinations_down"] else "")
    return f"draining node {node_id}: {_n(p['groups_copying'], 'group')} copying{frags}{down} ({p['seconds']:.0f} s)"


async def undrain_node(meta: Sequence[str], node_id: int, *, timeout: float = 20.0) -> dict[str, Any]:
    """Undo ``tierfs node drain``: the node's targets may take fragments
    again. Groups the drain already moved keep their new members (their
    copies finish: ``groups_copying`` counts them); the rebalancer then
    spreads data onto the node again (docs/operations.md)."""
    from tierfs.meta import MetaClient

    async with MetaClient(list(meta), deadline=timeout) as mc:
        was = await mc.undrain_node(node_id)
        cmap = await mc.get_cluster_map()
    mine = {t for n in cmap.nodes if n.node_id == node_id for t in n.target_ids}
    copying = sorted(g.group_id for g in cmap.groups if mine.intersection(g.rebuild_sources))
    return {"node": node_id, "was_draining": was, "groups_copying": copying}


async def remove_node(meta: Sequence[str], node_id: int, *, timeout: float = 20.0,
                      data_dir: str | None = None) -> dict[str, Any]:
    """Forget a drained (or dead and replaced) node; refused while a group
    needs it. ``data_dir``: a local cluster's directory; the node's daemon
    there (matched by its data address) is stopped and dropped from the
    plan, so that `tierfs up --data DIR` does not start it again as a new
    node."""
    from tierfs.meta import MetaClient

    out: dict[str, Any] = {"node": node_id, "removed": True, "local_daemon": None}
    async with MetaClient(list(meta), deadline=timeout) as mc:
        cmap = await mc.get_cluster_map()
        addr = next((n.data_addr for n in cmap.nodes if n.node_id == node_id), "")
        cl = proc = None
        if data_dir and addr:
            from tierfs.local import STATE_FILE, LocalCluster

            if (Path(data_dir) / STATE_FILE).exists():
                cl = LocalCluster.open(data_dir)
                # this cluster's plan only (a ./.tierfs of another one is left alone)
                ours = bool(set(cl.meta_addrs) & set(meta))
                proc = next((p for p in cl.procs if ours and p.kind == "storage" and p.addr == addr), None)
        mine = {t for n in cmap.nodes if n.node_id == node_id for t in n.target_ids}
        needed = any(mine.intersection(g.target_ids) or mine.intersection(g.rebuild_sources) for g in cmap.groups)
        # (a node a group still needs: meta refuses below, and its daemon runs on)
        running = (not needed and cl is not None and proc is not None
                   and proc.name in cl.stop(names=[proc.name]))
        # The daemon is stopped before meta forgets the node: stopped after,
        # a heartbeat in between found its node unknown and registered it
        # again, as a new node that stayed offline (status degraded) until
        # stop 49.
        try:
            await mc.remove_node(node_id)
        except BaseException:
            if running:  # refused (BUSY: a group still needs it): as it was
                assert cl is not None and proc is not None
                cl.start(names=[proc.name])
            raise
    if cl is not None and proc is not None:
        cl.procs.remove(proc)
        cl._save_state()
        out["local_daemon"] = proc.name
    return out


async def _control(addr: str, method: str, req: Any, timeout: float) -> Any:
    import grpc

    from tierfs.meta.auth import bearer, resolve_token
    from tierfs.proto.v1 import storage_control_pb2_grpc as sg
    from tierfs.tls import grpc_channel, resolve_client_tls

    # The node checks an admin operation's token with meta (StorageControl.Scrub).
    md = bearer(resolve_token())
    async with grpc_channel(addr, resolve_client_tls()) as ch:
        try:
            return await getattr(sg.StorageControlStub(ch), method)(req, timeout=timeout,  # type: ignore[no-untyped-call]
                                                                    metadata=md)
        except grpc.aio.AioRpcError as exc:
            # Meta answers an admin check's refusal with its own code; an
            # UNAVAILABLE here is the storage daemon (it said "meta").
            raise from_grpc(exc, service=f"storage daemon at {addr}") from None


#: Per-node scrub counts, in the order the table shows them.
SCRUB_FIELDS = ("fragments", "bytes", "chunks_verified", "corrupt", "missing", "mismatched", "repaired", "stale",
                "stale_deleted", "orphans", "orphans_deleted", "errors", "kept_young", "waiting_gc")
#: Counts that say the cluster is not whole (tierfs.storage.scrub.PROBLEMS).
_PROBLEMS = ("corrupt", "missing", "mismatched", "stale", "orphans", "errors")


async def scrub_cluster(meta: Sequence[str], *, rate: int = 0, repair: bool = True, delete_orphans: bool = True,
                        timeout: float = 600.0) -> dict[str, Any]:
    """One scrub pass on every online storage node at once (verify CRC32C of
    every fragment, check every committed chunk whole against its record in
    meta, rebuild corrupt, missing and mismatched fragments, count stale
    fragments of older generations, delete stale ones and orphans older than
    each node's ``orphan_grace``). Nodes that cannot be reached are listed
    with their error.

    ``clean`` is true only if every node was scrubbed, none found anything
    (stale fragments and orphans younger than the orphan grace, counted
    ``kept_young``, are expected: an upload in flight), and meta's repair
    queue holds no fragment position (asked after the pass): a node that is
    down, or a fragment known missing, is not clean.

    ``left`` lists what the pass leaves wrong with the data: errors, nodes
    not scrubbed, fragment positions awaiting rebuild, and, with
    ``repair`` off, the corrupt, missing and mismatched it found. Empty
    when the pass fixed everything it found (``tierfs scrub`` exits 0),
    even if it was not clean. Stale fragments and orphans kept (deletion
    off) waste space but lose nothing, so they are not in it."""
    from google.protobuf.json_format import MessageToDict

    from tierfs.errors import PermissionDeniedError
    from tierfs.meta import MetaClient
    from tierfs.proto.v1 import meta_pb2 as pb
    from tierfs.proto.v1 import storage_control_pb2 as spb

    async with MetaClient(list(meta), deadline=min(timeout, 20.0)) as mc:
        cmap = await mc.get_cluster_map()
    req = spb.ScrubRequest(rate=rate, repair=repair, delete_orphans=delete_orphans)
    nodes = [n for n in cmap.nodes if n.state == pb.NODE_STATE_ONLINE]

    async def one(n: Any) -> dict[str, Any]:
        if not n.control_addr:
            return {"node": n.node_id, "error": "the node registered no control address (an older daemon?)"}
        try:
            rep = await _control(n.control_addr, "Scrub", req, timeout)
        except PermissionDeniedError:
            raise  # the caller's token, the same at every node: one error, not a table of them
        except TierFSError as exc:
            return {"node": n.node_id, "error": f"{type(exc).__name__}: {exc}"}
        d = MessageToDict(rep, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        d["node"] = n.node_id
        for k in SCRUB_FIELDS:
            d[k] = int(d.get(k, 0))
        for i in d.get("issues", []):
            for k in ("target_id", "inode", "chunk", "version"):
                i[k] = int(i.get(k, 0))
        d.pop("node_id", None)
        return d

    t0 = time.perf_counter()
    per_node = list(await asyncio.gather(*(one(n) for n in nodes)))
    total = {k: sum(int(r.get(k, 0)) for r in per_node) for k in SCRUB_FIELDS}
    total["unreachable"] = sum(1 for r in per_node if "error" in r)
    offline = [n.node_id for n in cmap.nodes if n.state != pb.NODE_STATE_ONLINE]
    try:
        async with MetaClient(list(meta), deadline=min(timeout, 20.0)) as mc:
            total["repairs_pending"] = int((await mc.list_repairs([], limit=1)).pending)
    except TierFSError:
        total["repairs_pending"] = -1  # unknown: not clean
    leftover = total["stale"] + total["orphans"] - total["kept_young"]
    clean = (not offline and total["unreachable"] == 0 and total["repairs_pending"] == 0
             and not any(total[k] for k in _PROBLEMS if k not in ("stale", "orphans")) and leftover <= 0)
    left = []
    if total["errors"]:
        left.append(f"{total['errors']} error(s)")
    if total["unreachable"] or offline:
        left.append(f"{total['unreachable'] + len(offline)} node(s) not scrubbed")
    if total["repairs_pending"]:
        left.append("repair queue unknown" if total["repairs_pending"] < 0 else
                    f"{total['repairs_pending']} fragment position(s) awaiting rebuild")
    if not repair and total["corrupt"] + total["missing"] + total["mismatched"]:
        left.append(f"{total['corrupt']} corrupt, {total['missing']} missing, {total['mismatched']} mismatched "
                    f"not repaired (--no-repair)")
    return {"seconds": time.perf_counter() - t0, "total": total, "nodes": per_node, "offline_nodes": offline,
            "clean": clean, "left": left}


def render_scrub(r: dict[str, Any]) -> str:
    from tierfs.cli.util import human_size

    cols = ["fragments", "bytes", "chunks_verified", "corrupt", "missing", "mismatched", "repaired", "stale",
            "orphans", "deleted", "errors"]

    def cell(n: dict[str, Any], c: str) -> Any:
        if c == "bytes":
            return human_size(n[c])
        if c == "deleted":  # stale fragments and orphans deleted
            return n["stale_deleted"] + n["orphans_deleted"]
        return n[c]

    rows = [[n["node"], *(cell(n, c) for c in cols)] if "error" not in n
            else [n["node"], "unreachable: " + n["error"], *[""] * (len(cols) - 1)] for n in r["nodes"]]
    t = r["total"]
    rows.append(["total", *(cell(t, c) for c in cols)])
    header = ["NODE", "FRAGMENTS", "BYTES", "CHUNKS", "CORRUPT", "MISSING", "MISMATCHED", "REPAIRED", "STALE",
              "ORPHANS", "DELETED", "ERRORS"]
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    issues = [(n["node"], i) for n in r["nodes"] for i in n.get("issues", [])]
    # What matters first: bad fragments and chunks, then what was deleted,
    # then what was kept (young orphans of uploads in flight can be thousands).
    issues.sort(key=lambda x: (x[1]["kind"] not in ("corrupt", "missing", "mismatched"), x[1]["action"] == "kept"))
    if issues:
        lines.append("")
        for node, i in issues[:50]:
            lines.append(f"node {node} target {i['target_id']}: {i['kind']} inode {i['inode']} chunk {i['chunk']} "
                         f"fragment {i.get('fragment', 0)} generation {i['version']:#x}: {i['action']}"
                         + (f" ({i['detail']})" if i.get("detail") else ""))
        if len(issues) > 50:
            lines.append(f"... and {len(issues) - 50} more (--json lists them all)")
    if r["offline_nodes"]:
        lines.append(f"not scrubbed (offline): nodes {r['offline_nodes']}")
    pending = t.get("repairs_pending", 0)
    if pending:
        lines.append("repair queue: unknown (meta did not answer)" if pending < 0 else
                     f"repair queue: {pending} fragment position(s) known missing or bad, awaiting rebuild")
    young = t.get("kept_young", 0)
    kept = (f"; {young} stale fragment(s) or orphan(s) younger than the orphan grace kept (uploads in flight, "
            f"or copies a rebalance or repair moved away from lately; a later scrub deletes them)") if young else ""
    waiting = t.get("waiting_gc", 0)
    if waiting:
        kept += (f"; {waiting} fragment(s) of generations waiting for GC kept (replaced or removed less than "
                 f"gc_grace ago: open readers may still read them; GC deletes them)")
    took = f"in {r['seconds']:.2f} s"
    if r["clean"]:
        lines.append(f"scrub clean {took}{kept}")
    elif r.get("left"):
        lines.append(f"scrub found problems it did not fix {took}: {', '.join(r['left'])}{kept}")
    else:
        done = [f"repaired {t['repaired']} fragment(s)"] if t["repaired"] else []
        deleted = t["stale_deleted"] + t["orphans_deleted"]
        if deleted:
            done.append(f"deleted {deleted} stale fragment(s) or orphan(s)")
        spare = t["stale"] + t["orphans"] - deleted - young
        if spare > 0:
            done.append(f"kept {spare} stale fragment(s) or orphan(s) past the grace (--keep-orphans)")
        if not done:  # only findings that put nothing at risk (a bad fragment no file needs, say)
            found = [f"{t[k] - (young if k == 'orphans' else 0)} {k}" for k in ("corrupt", "missing", "mismatched",
                                                                                "stale", "orphans")
                     if t[k] - (young if k == "orphans" else 0) > 0]
            done = [f"found {', '.join(found) or 'problems'}"]
        lines.append(f"scrub {' and '.join(done)} {took}: no data left at risk{kept}")
    return "\n".join(lines)


async def rebuild_progress(cmap: Any, timeout: float = 2.0) -> dict[int, dict[str, Any]]:
    """Per rebuilding group, the progress its rebuilding members' nodes
    report: ``{group: {"done": n, "total": n, "bytes": n, "targets": [...]}}``,
    with ``"unreachable": [targets]`` where a rebuilding target's node did
    not answer (its progress is not known)."""
    from tierfs.proto.v1 import storage_control_pb2 as spb

    want: dict[int, set[int]] = {g.group_id: set(g.rebuilding) for g in cmap.groups if g.rebuilding}
    if not want:
        return {}
    owner = {t: n for n in cmap.nodes for t in n.target_ids}
    nodes = list({owner[t].node_id: owner[t] for ts in want.values() for t in ts if t in owner}.values())

    silent: set[int] = set()  # nodes that did not answer: their progress is not known

    async def one(n: Any) -> list[Any]:
        if not n.control_addr:
            silent.add(n.node_id)
            return []
        try:
            return list((await _control(n.control_addr, "RepairStatus", spb.RepairStatusRequest(), timeout)).rebuilds)
        except TierFSError:
            silent.add(n.node_id)
            return []

    found = await asyncio.gather(*(one(n) for n in nodes))
    out: dict[int, dict[str, Any]] = {g: {"done": 0, "total": 0, "bytes": 0, "targets": sorted(ts)}
                                      for g, ts in want.items()}
    for g, ts in want.items():
        # Until stop 48 such a target read "0/0 chunks, 0 B written", as a
        # copy that had just begun.
        dark = sorted(t for t in ts if t in owner and owner[t].node_id in silent)
        if dark:
            out[g]["unreachable"] = dark
    for reb in found:
        for p in reb:
            if p.group_id in want and p.target_id in want[p.group_id] and p.state != "finished":
                o = out[p.group_id]
                o["done"] += p.done
                o["total"] += p.total
                o["bytes"] += p.bytes
                if p.error:
                    o["error"] = p.error
    return out


async def repair_failures(cmap: Any, timeout: float = 2.0) -> dict[str, Any]:
    """What the online nodes' repair-queue workers could not rebuild in their
    last round: ``{"unrebuildable": [{"inode", "chunk", "generation",
    "detail"}], "errors": [{"node", "errors", "error"}]}``. A chunk listed
    unrebuildable had too few readable fragments: lost unless a node
    holding one of them comes back."""
    from tierfs.proto.v1 import meta_pb2 as pb
    from tierfs.proto.v1 import storage_control_pb2 as spb

    nodes = [n for n in cmap.nodes if n.control_addr and n.state == pb.NODE_STATE_ONLINE]

    async def one(n: Any) -> Any:
        try:
            return await _control(n.control_addr, "RepairStatus", spb.RepairStatusRequest(), timeout)
        except TierFSError:
            return None

    lost: dict[tuple[int, int, int], str] = {}
    errors = []
    for n, rep in zip(nodes, await asyncio.gather(*(one(n) for n in nodes)), strict=True):
        if rep is None:
            continue
        for u in rep.unrebuildable:
            lost.setdefault((u.inode, u.chunk, u.version), u.detail)
        if rep.queue_error:
            errors.append({"node": n.node_id, "errors": rep.queue_errors, "error": rep.queue_error})
    return {"unrebuildable": [{"inode": i, "chunk": c, "generation": v, "detail": d}
                              for (i, c, v), d in sorted(lost.items())],
            "errors": errors}


# ---- the command line ------------------------------------------------------------------


def add_commands(cmd: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``target``, ``node`` and ``scrub`` on the ``tierfs`` parser
    (``cmd(name, help)`` makes a sub-command parser)."""
    from tierfs.cli.util import parse_size_arg

    p = cmd("target", "storage targets: rm (declare dead, rebuild its fragments elsewhere)")
    p.add_argument("action", choices=["rm"])
    p.add_argument("id", type=int)
    p.add_argument("--force", action="store_true",
                   help="remove it even where it is online and the last readable copy of a group (that data is lost)")
    p = cmd("node", "storage nodes: drain (move all fragments off), undrain (undo a drain: it takes fragments "
                    "again), rm (forget a drained node) or label (--rack R: its failure domain)")
    p.add_argument("action", choices=["drain", "undrain", "rm", "label"])
    p.add_argument("id", type=int)
    p.add_argument("--wait", action="store_true", help="drain: wait until every fragment has moved")
    p.add_argument("--rack", default=None, help="label: the node's rack ('' clears it)")
    p = cmd("scrub", "verify every fragment and every chunk on every node now, repair what is bad, delete stale "
                     "fragments and orphans")
    p.add_argument("--rate", type=parse_size_arg, default=0, help="bytes/s per node (default: unthrottled)")
    p.add_argument("--no-repair", dest="repair", action="store_false", help="only report")
    p.add_argument("--keep-orphans", dest="orphans", action="store_false",
                   help="do not delete orphans and stale fragments")


def execute(ns: argparse.Namespace, meta: Sequence[str], emit: Callable[[Any, str | None], None],
            run: Callable[[Any], Any], err: TextIO | None = None) -> int | None:
    """Run ``ns`` if it is one of this module's commands; its exit code (None: not ours)."""
    if ns.cmd == "target":
        r = run(remove_target(meta, ns.id, timeout=ns.timeout, force=ns.force))
        emit(r, f"target {ns.id} removed; " + (f"its {_n(r['groups'], 'group')} are rebuilding elsewhere"
                                                 if r["groups"] else "it was in no group: nothing to rebuild")
             + (f" (no replacement for groups {r['groups_stuck']}: they stay degraded)" if r["groups_stuck"] else ""))
        return 0
    if ns.cmd == "node" and ns.action == "drain":
        shown: Callable[[dict[str, Any]], None] | None = None
        if ns.wait and err is not None and not ns.json:
            every = {"next": 0.0}

            def shown(p: dict[str, Any]) -> None:
                # a line every 5 s (and the first at once): for terminals and logs alike
                if p["seconds"] >= every["next"]:
                    every["next"] = p["seconds"] + 5.0
                    err.write(drain_line(ns.id, p) + "\n")
                    err.flush()

        r = run(drain_node(meta, ns.id, wait=ns.wait, timeout=max(ns.timeout, 600.0) if ns.wait else ns.timeout,
                           progress=shown))
        state = ("drained: stop its daemon, then `tierfs node rm` may remove it (a daemon still running "
                 "registers again as a new node)") if r["done"] else (
            f"draining: {_n(len(r['groups_copying']), 'group')} copying from it")
        emit(r, f"node {ns.id} {state}"
             + (f"; no replacement for groups {r['groups_stuck']}" if r["groups_stuck"] else ""))
        return 0 if not r["groups_stuck"] else 1
    if ns.cmd == "node" and ns.action == "undrain":
        r = run(undrain_node(meta, ns.id, timeout=ns.timeout))
        if not r["was_draining"]:
            emit(r, f"node {ns.id} was not draining: nothing changed")
        else:
            emit(r, f"node {ns.id} takes fragments again; the rebalancer moves data back onto it"
                 + (f" (the drain's copies of {_n(len(r['groups_copying']), 'group')} finish first)"
                    if r["groups_copying"] else ""))
        return 0
    if ns.cmd == "node" and ns.action == "rm":
        from tierfs.cli.util import DEFAULT_DATA

        r = run(remove_node(meta, ns.id, timeout=ns.timeout, data_dir=ns.data or DEFAULT_DATA))
        emit(r, f"node {ns.id} removed; " + (
            f"its local daemon {r['local_daemon']} stopped and dropped from the local cluster's plan"
            if r["local_daemon"] else "if its daemon still runs, it registers again as a new node: stop it"))
        return 0
    if ns.cmd == "scrub":
        r = run(scrub_cluster(meta, rate=ns.rate, repair=ns.repair, delete_orphans=ns.orphans,
                              timeout=max(ns.timeout, 600.0)))
        emit(r, render_scrub(r))
        return 1 if r["left"] else 0
    return None
