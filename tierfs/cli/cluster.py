"""Cluster-wide commands: ``up`` and ``down`` (a local cluster under one
directory, via :class:`tierfs.local.LocalCluster`) and ``status`` (any
cluster: meta roles, storage nodes and targets, placement groups, KV pools
and their usage). Each
returns plain data; :mod:`tierfs.cli.main` prints it."""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Sequence
from typing import Any

from tierfs.cli.kv import pool_summaries
from tierfs.errors import (
    ConfigError,
    PermissionDeniedError,
    TierFSError,
    UnauthenticatedError,
    UnavailableError,
)
from tierfs.local import LocalCluster

__all__ = ["cluster_down", "cluster_status", "cluster_up"]


def _state(enum_name: str, prefix: str) -> str:
    return enum_name.removeprefix(prefix).lower()


#: The most storage daemons ``tierfs up`` starts on one machine.
MAX_LOCAL_STORAGE = 256


def cluster_up(data_dir: str, *, n_meta: int = 3, n_storage: int | None = None, targets_per_node: int = 1,
               timeout: float = 90.0, tls: bool = False) -> dict[str, Any]:
    """Start (or reuse) the local cluster in ``data_dir`` and wait until it is
    healthy. A directory that already holds a cluster keeps its plan (ports,
    counts, data); daemons already running are left alone, so a second ``up``
    is a no-op. If start-up fails, the daemons this call started are stopped
    again. ``tls``: every daemon serves mutual TLS with certificates of a
    local CA under DATA/tls/ (a cluster made with it stays TLS).

    ``n_storage`` (default 6) on a directory that holds a cluster grows it:
    storage daemons are added up to that many (the running ones are left
    alone; placement then rebalances onto the new ones)."""
    if n_storage is not None and not 1 <= n_storage <= MAX_LOCAL_STORAGE:
        # 0 used to start the default 6; 100000 ran out of file descriptors half-way.
        raise ConfigError(f"must be between 1 and {MAX_LOCAL_STORAGE} on one machine, not {n_storage}",
                          field="storage")
    cl = LocalCluster(data_dir, n_meta=n_meta, n_storage=6 if n_storage is None else n_storage,
                      targets_per_node=targets_per_node, tls=tls)
    # grow() refuses fewer than planned (it used to say "nothing to do" and
    # exit 0 for `--storage 3` on a cluster of 8)
    added = cl.grow(n_storage) if cl.reused and n_storage and n_storage != cl.counts["storage"] else []
    started = cl.up(timeout=timeout)
    health = asyncio.run(cl.health(deadline=min(timeout, 10.0)))
    return {
        # Up, yet a target whose disk is too full takes no writes (until stop
        # 48 `up` said "every daemon up" with every target read-only).
        "read_only_targets": health["read_only_targets"],
        "root_layout": health.get("root_layout", ""),
        "targets": health["targets"],
        "data_dir": str(cl.dir),
        "meta": cl.meta_addrs,
        "started": started,
        "already_running": not started,
        "added": added,
        "reused": cl.reused,
        "counts": cl.counts,
        "cluster_secret": str(cl.secret_file),  # made on the first up (docs/raft.md)
        # Derived from the secret, mode 0600 (docs/security.md)
        "admin_token": str(cl.admin_token_file),
        "node_key": str(cl.node_key_file),
        # Clients find DATA/tls/ca.pem (and client.pem) by themselves; elsewhere: TIERFS_TLS_CA etc.
        "tls_ca": str(cl.tls_dir / "ca.pem") if cl.tls else "",
        # Prometheus endpoints of the meta replicas (deploy/grafana/tierfs.json)
        "metrics": cl.metrics_addrs,
        "storage_metrics": cl.storage_metrics_addrs,
        "export": exports(cl),
    }


def exports(cl: LocalCluster) -> str:
    """The shell lines that point the CLI and clients at ``cl`` from any
    directory: its meta addresses, its admin token and, with TLS, its CA
    and client certificate (absolute paths). Without the token line a
    shell outside the data directory's parent got "no credential"."""
    env = {"TIERFS_META": ",".join(cl.meta_addrs), "TIERFS_TOKEN_FILE": str(cl.admin_token_file.resolve())}
    if cl.tls:
        from tierfs.tls import CA_FILE, CLIENT_NAME

        tls = cl.tls_dir.resolve()
        env |= {"TIERFS_TLS_CA": str(tls / CA_FILE), "TIERFS_TLS_CERT": str(tls / f"{CLIENT_NAME}.pem"),
                "TIERFS_TLS_KEY": str(tls / f"{CLIENT_NAME}.key")}
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())


def cluster_down(data_dir: str, *, timeout: float = 15.0) -> dict[str, Any]:
    """Stop every daemon of the local cluster in ``data_dir`` (SIGTERM, then
    SIGKILL after ``timeout``). Its data stays; ``up`` starts it again."""
    cl = LocalCluster.open(data_dir)
    stopped = cl.stop(timeout=timeout)
    return {"data_dir": str(cl.dir), "stopped": stopped}


async def _replica_status(addr: str, timeout: float) -> dict[str, Any]:
    from tierfs.meta import MetaClient

    try:
        async with MetaClient([addr], deadline=timeout, attempt_timeout=min(timeout, 1.0)) as mc:
            st = await mc.status(addr=addr)
    except TierFSError as exc:
        # The client's own "cluster unreachable: tried ADDR (last error: X)"
        # would nest in the caller's message: keep X.
        msg = str(exc)
        if msg.startswith("cluster unreachable: tried ") and "(last error: " in msg:
            msg = msg.split("(last error: ", 1)[1].rstrip(")")
        state = "refused" if isinstance(exc, (UnauthenticatedError, PermissionDeniedError)) else "unreachable"
        return {"addr": addr, "id": None, "role": None, "state": state, "error": msg,
                "leader": "", "members": [], "term": None, "exc": exc}
    return {"addr": addr, "id": st.id, "role": st.role, "state": "up", "leader": st.leader,
            "self": st.raft.grpc_addr if st.HasField("raft") else "",
            "members": list(st.members), "term": st.term, "commit_index": st.commit_index,
            "applied_index": st.applied_index, "auth": st.auth}


def kv_lease_summary(reply: Any) -> dict[str, Any] | None:
    """The KV map leases of a ListKVPools answer (docs/kv.md, "Map leases"):
    None when the leader grants none (or predates the field)."""
    if not reply.leases_on:
        return None
    return {
        "map_version": reply.map_version,
        "published": reply.kv_published,
        "nodes": [{"node_id": n.node_id, "leased": n.leased, "applied_map_version": n.applied_map_version,
                   "granted_ms_ago": n.granted_ms_ago if n.granted_ms_ago or n.leased else None,
                   "stalled": n.stalled} for n in reply.leases],
        "stalled": [n.node_id for n in reply.leases if n.stalled],
    }


async def cluster_status(meta: Sequence[str], *, data_dir: str | None = None,
                         timeout: float = 5.0) -> dict[str, Any]:
    """Every daemon with its role and state, every target with its capacity
    and use, every placement group healthy or degraded.

    ``meta``: any subset of the meta replicas (the others are found through
    the members list). ``data_dir``: a local cluster's directory, to report
    pids (``None`` leaves them null). Raises ``UnavailableError`` when no
    replica answers."""
    from tierfs.meta import MetaClient
    from tierfs.proto.v1 import meta_pb2 as pb

    local = LocalCluster.open(data_dir) if data_dir else None
    pids = {p.addr: p.pid for p in local.procs} if local else {}
    procs = {p.addr: p for p in local.procs} if local else {}
    names = {p.addr: p.name for p in local.procs} if local else {}
    addrs = list(dict.fromkeys([*meta, *(local.meta_addrs if local else [])]))
    per_replica = min(timeout, 2.0)
    replicas = list(await asyncio.gather(*(_replica_status(a, per_replica) for a in addrs)))
    # Replicas the caller did not name but the cluster has (members are gRPC
    # addresses). A replica that answered says which member it is ("self"):
    # named by another address (a short DNS name, localhost), it is not
    # asked again under its member address, which listed it twice.
    answered = {r["self"] for r in replicas if r.get("self")}
    extra = [m for r in replicas for m in r["members"] if m not in addrs and m not in answered]
    extra = list(dict.fromkeys(extra))
    if extra:
        replicas += await asyncio.gather(*(_replica_status(a, per_replica) for a in extra))
        addrs += extra
    if all(r["state"] != "up" for r in replicas):
        if local is not None and not any(local.running().values()):
            raise UnavailableError(f"the local cluster in {local.dir} is not running; "
                                   f"start it with `tierfs up --data {data_dir}`")
        refused = [r["exc"] for r in replicas if isinstance(r.get("exc"), (UnauthenticatedError,
                                                                          PermissionDeniedError))]
        if refused:
            # They answered, and refused the credential (or its absence):
            # say that, not "unreachable ... is the cluster running?".
            raise refused[0]
        errors = "; ".join(f"{r['addr']}: {r['error']}" for r in replicas)
        raise UnavailableError(f"cluster unreachable: tried {', '.join(addrs)} ({errors})")

    leaders = {r["leader"] for r in replicas if r["state"] == "up" and r["leader"]}
    meta_out = []
    # The leader's member list: a replica outside it was removed
    # (`tierfs meta-replica rm`); it no longer counts for the cluster's health.
    lead = next((r for r in replicas if r["state"] == "up" and r["role"] == "leader"), None)
    meta_members = set(lead["members"]) if lead is not None and lead["members"] else None
    for r in replicas:
        pid = pids.get(r["addr"]) if local else None
        if local and pid is not None and r["state"] != "up" and not procs[r["addr"]].alive():
            r["state"] = "down"
        # Only a replica that answers can be told apart as removed (one that
        # does not may be a member known by another address: it counts).
        member = (meta_members is None or r["state"] != "up" or r["addr"] in meta_members
                  or r.get("self") in meta_members)
        meta_out.append({
            # A replica that does not answer is named from the local plan, if any.
            "id": r["id"] or names.get(r["addr"]), "addr": r["addr"], "role": r["role"], "state": r["state"],
            "pid": pid or None, "term": r["term"], "applied_index": r.get("applied_index"),
            "member": member,
            # Why it did not answer (a refused credential, TLS, a timeout): the
            # table said "unreachable" alone, also for a replica up with
            # another cluster secret (stop 47).
            **({"error": r["error"]} if r.get("error") and r["state"] != "down" else {}),
        })

    meta_out.sort(key=lambda m: (m["id"] is None, m["id"] or "", m["addr"]))
    try:
        async with MetaClient(addrs, deadline=timeout, attempt_timeout=min(timeout, 2.0)) as mc:
            cmap = await mc.get_cluster_map()
            # Fragments of committed chunks known missing (degraded writes, scrub
            # findings) that the repair queue has not rebuilt yet.
            repairs = (await mc.list_repairs([], limit=1)).pending
            kv_reply = await mc.list_kv_pools()
            try:
                from tierfs.cli.rebalance import status_dict

                rebalance: dict[str, Any] | None = status_dict(await mc.rebalance_status())
            except TierFSError:
                rebalance = None  # an older leader, or no leader this moment: status shows the rest
    except TierFSError as exc:
        up = sum(m["state"] == "up" for m in meta_out)
        if up > len(meta_out) // 2 and any(r["state"] == "up" and r["role"] == "leader" for r in replicas):
            raise  # a leader with a majority answered us: this is another failure
        # (A follower may still name a dead leader until its election timeout,
        # and a leader that lost its majority still says "leader" until it
        # steps down, which it may do between our two calls.)
        # No majority (or no election won yet): what the replicas say, and
        # nothing from the map, which only a leader serves. Until stop 44
        # this was "cluster unreachable" and no table at all.
        auth0 = {r.get("auth") for r in replicas if r["state"] == "up"}
        return {
            "healthy": False, "security": "mixed" if len(auth0) > 1 else ("on" if auth0 == {True} else "off"),
            "leader": None, "map_version": None,
            "no_leader": f"no meta leader: {up} of {len(meta_out)} replicas answer, and a leader needs "
                         f"{len(meta_out) // 2 + 1} of them (start the ones that are down; `tierfs up --data DIR` "
                         f"for a local cluster): {exc}",
            "meta": meta_out, "storage": [], "groups": [], "repairs_pending": 0, "kv_pools": [],
            "kv_leases": None, "rebalance": None, "capacity": 0, "used": 0,
        }

    targets: dict[int, dict[str, Any]] = {}
    grouped = {m for g in cmap.groups for m in g.target_ids}
    for t in cmap.targets:
        state = _state(pb.TargetState.Name(t.state), "TARGET_STATE_")
        if state == "failed" and t.target_id not in grouped:
            # Removed (`tierfs target rm`) or failed, and in no group any
            # more: nothing waits on it. Until stop 47 the cluster stayed
            # DEGRADED for good after a `target rm` on a live node.
            state = "failed, out of use"
        targets[t.target_id] = {
            "id": t.target_id, "node_id": t.node_id, "path": t.path,
            "state": state,
            "capacity": t.capacity, "used": t.used,
            # The last committed figure (a new leader not yet reported to).
            "used_unreported": t.used_unreported,
        }
    storage_out = []
    seen_addrs = set()
    for n in sorted(cmap.nodes, key=lambda n: n.node_id):
        seen_addrs.add(n.data_addr)
        pid = (pids.get(n.data_addr) or None) if local else None
        state = _state(pb.NodeState.Name(n.state), "NODE_STATE_")
        if local and n.data_addr in pids and not procs[n.data_addr].alive():
            # Meta notices a dead node only after its heartbeat timeout; we know now.
            state = "down"
        storage_out.append({
            "id": n.node_id, "addr": n.control_addr or n.data_addr, "data_addr": n.data_addr,
            "hostname": n.hostname, "name": names.get(n.data_addr), "state": state, "pid": pid,
            "draining": n.draining, "rack": n.rack,
            "targets": [targets[t] for t in n.target_ids if t in targets],
        })
    if local:
        # Daemons of the local plan that never registered (e.g. killed during start-up).
        for p in local.procs:
            if p.kind == "storage" and p.addr not in seen_addrs:
                storage_out.append({"id": None, "addr": p.addr, "data_addr": p.addr, "hostname": "", "name": p.name,
                                    "state": "unregistered", "pid": p.pid or None, "targets": []})

    groups_out = []
    for g in sorted(cmap.groups, key=lambda g: g.group_id):
        members = [{"id": t, "state": targets[t]["state"] if t in targets else "unknown",
                    "rebuilding": t in g.rebuilding} for t in g.target_ids]
        bad = sum(m["state"] != "online" for m in members)
        state = "degraded" if bad else ("rebuilding" if g.rebuilding else "healthy")
        groups_out.append({"id": g.group_id, "width": g.width, "state": state, "targets": members})
    if any(g.rebuilding for g in cmap.groups):
        from tierfs.cli.repair import rebuild_progress

        progress = await rebuild_progress(cmap, timeout=min(timeout, 2.0))
        for out in groups_out:
            if out["id"] in progress:
                out["rebuild"] = progress[out["id"]]

    failures = None
    if repairs:
        from tierfs.cli.repair import repair_failures

        failures = await repair_failures(cmap, timeout=min(timeout, 2.0))
    kv_pools = pool_summaries(kv_reply)
    for pool in kv_pools:
        # Groups reading around a member that is down (a redundant pool
        # holds its position until replace_after: docs/kv_pools.md).
        down = sum(any(targets.get(t, {}).get("state") not in ("online", "read_only") for t in g)
                   for g in pool["groups"])
        pool["groups_down"] = down
        if down and pool["placement"] == "ok":
            pool["placement"] = (f"{down} of {len(pool['groups'])} groups with a member down: reads go around it "
                              f"(held in place until meta's replace_after, then replaced)" if pool["width"] > 1 else
                              f"{down} of {len(pool['groups'])} groups with their one member down: their keys are "
                              f"misses until it is replaced")
    kv_leases = kv_lease_summary(kv_reply)
    if kv_leases is not None:
        # Nodes a new leader has not heard from yet are not in its list.
        kv_leases["online_nodes"] = sum(s["state"] == "online" for s in storage_out)
    healthy = (
        len(leaders) == 1
        and bool(storage_out)  # no storage node: nothing can be stored ("healthy" until stop 47)
        # every member up as leader or follower (a candidate is not; a
        # removed replica does not count: until stop 47 both said healthy
        # or DEGRADED for good the other way round)
        and all(m["state"] == "up" and m["role"] in ("leader", "follower") for m in meta_out if m["member"])
        and all(s["state"] == "online" for s in storage_out)
        and all(t["state"] in ("online", "failed, out of use") for t in targets.values())
        and all(g["state"] == "healthy" for g in groups_out)
        and repairs == 0
        and not (kv_leases and kv_leases["stalled"])
    )
    auth = {r.get("auth") for r in replicas if r["state"] == "up"}
    return {
        "healthy": healthy,
        # "on", "off" (--insecure-no-auth), or "mixed" while replicas disagree
        "security": "mixed" if len(auth) > 1 else ("on" if auth == {True} else "off"),
        "leader": next(iter(leaders)) if len(leaders) == 1 else None,
        "map_version": cmap.version,
        "meta": meta_out,
        "storage": storage_out,
        "groups": groups_out,
        "repairs_pending": repairs,
        # With repairs pending: what the nodes' repair queues could not
        # rebuild last round ({"unrebuildable": [...], "errors": [...]}).
        "repair_failures": failures,
        # Definitions and the usage storage nodes last reported (zeros where none).
        "kv_pools": kv_pools,
        # KV map leases as the leader sees them (None: no leases, or a leader
        # of an older release); a stalled node makes the cluster degraded.
        "kv_leases": kv_leases,
        # The leader's rebalance progress and the failure-domain sentence (docs/rebalance.md).
        "rebalance": rebalance,
        "capacity": sum(t["capacity"] for t in targets.values()),
        "used": sum(t["used"] for t in targets.values()),
    }
