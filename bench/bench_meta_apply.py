"""What one meta op costs to apply as the cluster grows (docs/scale.md,
"Meta apply at scale").

Every replica applies every committed op on its event loop, so an apply
that grows with the number of targets or placement groups caps the whole
cluster's metadata rate. This runs the real ``MetaStateMachine`` in this
process, no daemons: a cluster of N storage nodes with one target each
(one placement group of width 6 per target, as the leader plans them),
then a few hundred creates, mkdirs, write sessions (open and commit of a
4-chunk file) and, for the ops logged only when something changes, node
heartbeats that change a target's state and ticks. The baseline is the
same op on a cluster of 6 targets in the same run; the ratio is that cost
over the cost at N (1.0: it does not grow; 0.1: ten times dearer).

    python -m bench.bench_meta_apply [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from tierfs.chunk import generation
from tierfs.meta.rebalance import plan_top_up, top_up_input
from tierfs.meta.state import OP_FORMAT, MetaStateMachine
from tierfs.proto.v1 import meta_pb2 as pb

SIZES_FULL = (6, 100, 1000, 10000)
SIZES_QUICK = (6, 100, 1000)
MiB = 1 << 20


class _Cluster:
    def __init__(self, nodes: int) -> None:
        self.sm = MetaStateMachine()
        self.now = 1_700_000_000 * 10**9
        self.rid = 0
        self.nodes: list[pb.RegisterNodeReply] = []
        for i in range(nodes):
            self.nodes.append(self.do("register_node", pb.RegisterNodeRequest(
                node_uuid=f"n-{i}", hostname=f"n{i}", data_addr=f"127.0.0.1:{9000 + i}",
                targets=[pb.TargetSpec(path="/data/t0", capacity=1 << 40)]), pb.RegisterNodeReply))
        for req in plan_top_up(top_up_input(self.sm, 6)):
            self.do("add_groups", req)
        self.do("mkdir", pb.MkdirRequest(loc=pb.Loc(path="/b")))

    def op(self, kind: str, req: Any) -> bytes:
        self.now += 1000
        self.rid += 1
        # Stamped as the leader's service stamps them (KV pool groups are
        # planned by the leader, not re-planned by apply).
        op = pb.MetaOp(now_ns=self.now, client_id="b" * 32, request_id=self.rid, min_format=OP_FORMAT,
                       lease_ms=60_000, kv_planned=True)
        getattr(op, kind).CopyFrom(req)
        return op.SerializeToString()

    def do(self, kind: str, req: Any, reply_cls: type = pb.Empty) -> Any:
        res = pb.MetaResult.FromString(self.sm.apply(self.op(kind, req)))
        if res.error.code:
            raise RuntimeError(f"{kind}: {res.error.message}")
        return reply_cls.FromString(res.reply)


def _time(c: _Cluster, ops: list[bytes]) -> float:
    """Microseconds per op, one pass (each op applies once)."""
    t = time.perf_counter()
    for o in ops:
        res = pb.MetaResult.FromString(c.sm.apply(o))
        if res.error.code:
            raise RuntimeError(res.error.message)
    return (time.perf_counter() - t) / len(ops) * 1e6


def measure(nodes: int, n: int) -> dict[str, float]:
    c = _Cluster(nodes)
    out: dict[str, float] = {}
    out["create"] = _time(c, [c.op("create", pb.CreateRequest(loc=pb.Loc(path=f"/b/f{i}"))) for i in range(n)])
    out["mkdir"] = _time(c, [c.op("mkdir", pb.MkdirRequest(loc=pb.Loc(path=f"/b/d{i}"))) for i in range(n)])
    t = time.perf_counter()
    sessions = [c.do("open_write", pb.OpenWriteRequest(loc=pb.Loc(path=f"/b/f{i}"), owner="b"), pb.OpenWriteReply)
                for i in range(n)]
    out["open_write"] = (time.perf_counter() - t) / n * 1e6
    out["commit_write"] = _time(c, [c.op("commit_write", pb.CommitWriteRequest(
        session_id=s.session_id, size=16 * MiB, chunks=[
            pb.ChunkRecord(index=j, generation=generation(s.data_version, 0), length=4 * MiB) for j in range(4)]))
        for s in sessions])
    # Heartbeats that change a target's state (the only ones logged):
    # full, then back, on successive nodes.
    hb = []
    for i in range(min(n, len(c.nodes))):
        r = c.nodes[i]
        for state in (pb.TARGET_STATE_READ_ONLY, pb.TARGET_STATE_ONLINE):
            hb.append(c.op("heartbeat", pb.HeartbeatRequest(node_id=r.node_id, targets=[
                pb.TargetReport(target_id=r.targets[0].target_id, state=state)])))
    out["heartbeat (state change)"] = _time(c, hb)
    out["tick"] = _time(c, [c.op("tick", pb.TickRequest(heartbeat_timeout_ms=3_600_000)) for _ in range(n // 4 or 1)])
    return out


def run(quick: bool = False) -> dict[str, Any]:
    sizes = SIZES_QUICK if quick else SIZES_FULL
    n = 200 if quick else 500
    per = {nodes: measure(nodes, n) for nodes in sizes}
    base = per[sizes[0]]
    rows = []
    for nodes in sizes[1:]:
        for kind, us in per[nodes].items():
            rows.append({"case": f"{kind}, {nodes} targets", "value": round(us, 1), "unit": "us/op",
                         "baseline": round(base[kind], 1), "baseline_name": f"{kind}, {sizes[0]} targets",
                         "ratio": base[kind] / us if us else None})
    notes = (f"Apply of one op by MetaStateMachine in one process (no Raft, no RPC), {n} ops of each kind; "
             "one target per node, one width-6 placement group per target. Ratio: cost at 6 targets over "
             "cost at N (1.0 = flat). Heartbeats and ticks reach the log only when they change something.")
    return {"name": "meta_apply", "rows": rows, "notes": notes, "per_size": per}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ns = ap.parse_args()
    print(json.dumps(run(ns.quick), indent=1))


if __name__ == "__main__":
    main()
