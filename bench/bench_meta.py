"""Metadata service throughput and commit latency against raw pysyncobj.

Starts a real 3-replica ``tierfs-meta`` cluster (three processes, loopback)
and drives it with :class:`tierfs.meta.MetaClient`: namespace creates
(``mkdir``: a Raft commit each) and ``stat`` (a linearizable read: one
shared no-op commit per batch of concurrent readers), with 1 and 16
concurrent callers. The ceiling, measured in the same run: a bare pysyncobj
counter in three processes with the same tuning, once with TierFS's durable
journal (fdatasync before every message) and once with pysyncobj's stock
in-memory journal.

    python -m bench.bench_meta [--quick]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import proc_cpu_s

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _selfproc_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _apply_us(n: int = 5000) -> float:
    """Microseconds one replica's state machine takes to apply one mkdir,
    in this process (no Raft, no RPC): the part of a create that every
    replica pays and a bare counter does not."""
    from tierfs.meta import MetaStateMachine
    from tierfs.proto.v1 import meta_pb2 as pb

    sm = MetaStateMachine()
    now = 1_700_000_000 * 10**9

    def op(i: int, path: str) -> bytes:
        m = pb.MetaOp(now_ns=now + i, client_id="bench" * 6, request_id=i + 1)
        m.mkdir.CopyFrom(pb.MkdirRequest(loc=pb.Loc(path=path)))
        return m.SerializeToString(deterministic=True)

    first = pb.MetaResult.FromString(sm.apply(op(0, "/bench")))
    if first.error.code:
        raise RuntimeError(f"apply benchmark: mkdir /bench failed: {first.error.message}")
    ops = [op(i, f"/bench/d{i}") for i in range(1, n + 1)]
    t0 = time.perf_counter()
    for o in ops:
        sm.apply(o)
    return (time.perf_counter() - t0) / n * 1e6


# --- raw pysyncobj: one process per node; the leader measures -----------------


def _raw_node(addr: str, peers: list[str], mode: str, data_dir: str, seconds: float) -> None:
    from pysyncobj import SyncObj, replicated
    from pysyncobj.transport import TCPTransport

    from tierfs.meta import raft as tr
    from tierfs.meta.journal import DurableJournal

    journal = DurableJournal(data_dir, fsync=mode == "durable") if mode in ("durable", "nofsync") else None

    class Counter(SyncObj):  # type: ignore[misc]
        def __init__(self) -> None:
            self.n = 0
            self.tfs_journal = journal
            extra: dict[str, Any] = {"journalFile": journal} if journal is not None else {}
            conf = tr.make_conf(tr.RaftTimings(), **extra)
            transport = tr._SyncingTransport if journal is not None else TCPTransport
            super().__init__(addr, peers, conf, transportClass=transport)

        @replicated  # type: ignore[misc]
        def incr(self) -> int:
            self.n += 1
            return self.n

    node = Counter()
    deadline = time.monotonic() + 60
    while not node._isLeader():
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
        if node._getLeader() is not None and not node._isLeader():
            time.sleep(0.5)  # someone else leads and measures; idle until killed
            continue
    time.sleep(0.3)

    def mark(name: str) -> None:
        # The parent reads every replica's CPU time at each mark.
        print(json.dumps({"mark": name}), flush=True)
        time.sleep(0.05)

    # 1 outstanding: commit latency
    lat: list[float] = []
    mark("seq0")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        node.incr(sync=True, timeout=5)
        lat.append(time.perf_counter() - t0)
    print(json.dumps({"mark": "seq1"}), flush=True)
    time.sleep(0.05)
    # 16 outstanding: throughput
    window = threading.Semaphore(16)
    done = [0]

    def cb(res: Any, err: Any) -> None:
        done[0] += 1
        window.release()

    mark("conc0")
    t0 = time.perf_counter()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        window.acquire()
        node.incr(callback=cb)
    for _ in range(16):
        window.acquire()
    conc = done[0] / (time.perf_counter() - t0)
    print(json.dumps({"mark": "conc1"}), flush=True)
    time.sleep(0.05)
    print(json.dumps({"seq_ops": len(lat) / sum(lat), "p50": _pct(lat, 0.5), "p99": _pct(lat, 0.99),
                      "conc_ops": conc, "seq_n": len(lat), "conc_n": done[0]}), flush=True)
    node.destroy()


def _raw_cluster(mode: str, seconds: float, tmp: Path) -> dict[str, float]:
    from tests.cluster import free_ports

    ports = free_ports(3)
    addrs = [f"127.0.0.1:{p}" for p in ports]
    procs = []
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for i, a in enumerate(addrs):
        peers = [x for x in addrs if x != a]
        args = [sys.executable, "-m", "bench.bench_meta", "--raw-node", a, ",".join(peers), mode,
                str(tmp / f"{mode}{i}"), str(seconds)]
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=ROOT))
    result: dict[str, float] = {}
    marks: dict[str, float] = {}
    lock = threading.Lock()
    pids = [p.pid for p in procs]

    def reader(p: subprocess.Popen[bytes]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith(b"{"):
                msg = json.loads(line)
                with lock:
                    if "mark" in msg:
                        with contextlib.suppress(OSError):
                            marks[msg["mark"]] = proc_cpu_s(pids)
                    else:
                        result.update(msg)

    threads = [threading.Thread(target=reader, args=(p,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 4 * seconds + 60
    while not result and time.monotonic() < deadline:
        time.sleep(0.1)
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()
        assert p.stdout is not None
        p.stdout.close()
    if not result:
        raise RuntimeError(f"raw pysyncobj {mode} cluster produced no result")
    if len(marks) == 4:
        # CPU of all three replicas per committed op (0 when not measured)
        result["seq_cpu_us"] = (marks["seq1"] - marks["seq0"]) / max(1, result["seq_n"]) * 1e6
        result["conc_cpu_us"] = (marks["conc1"] - marks["conc0"]) / max(1, result["conc_n"]) * 1e6
    return result


# --- the real service -----------------------------------------------------------------------


async def _creator(mc: Any, name: str, seconds: float, lat: list[float]) -> None:
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        t0 = time.perf_counter()
        await mc.mkdir(f"/bench/{name}-{i}")
        lat.append(time.perf_counter() - t0)
        i += 1


async def _statter(mc: Any, seconds: float, lat: list[float]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        await mc.stat("/bench")
        lat.append(time.perf_counter() - t0)


async def _log_len(mc: Any) -> int:
    """Entries in the leader's Raft log (no snapshot is taken in a run this short)."""
    from tierfs.proto.v1 import meta_pb2 as pb

    st = await mc._call("GetStatus", pb.Empty(), pb.GetStatusReply, addr=mc.leader)
    return int(st.raft.log_len)


async def _drive(addrs: list[str], seconds: float, pids: list[int]) -> dict[str, float]:
    from tierfs.meta import MetaClient

    out: dict[str, float] = {}
    async with MetaClient(addrs, deadline=30.0) as mc:
        await mc.mkdir("/bench")
        for conc in (1, 16):
            lat: list[float] = []
            entries0 = await _log_len(mc)
            calls0, batched0 = mc.batch_calls, mc.batched_ops
            cpu0, self0 = proc_cpu_s(pids), _selfproc_cpu_s()
            t0 = time.perf_counter()
            await asyncio.gather(*(_creator(mc, f"c{conc}-{w}", seconds, lat) for w in range(conc)))
            out[f"create_{conc}"] = len(lat) / (time.perf_counter() - t0)
            # CPU of the three replicas, and of this (the client's) process
            out[f"create_{conc}_cpu_us"] = (proc_cpu_s(pids) - cpu0) / max(1, len(lat)) * 1e6
            out[f"create_{conc}_client_cpu_us"] = (_selfproc_cpu_s() - self0) / max(1, len(lat)) * 1e6
            # group commit: how many creates shared one Raft entry (the
            # periodic tick's entries count too, so this is a lower bound)
            out[f"create_{conc}_per_entry"] = len(lat) / max(1, await _log_len(mc) - entries0)
            # batched calls: creates per RPC (a create on its own is one RPC)
            batched = mc.batched_ops - batched0
            out[f"create_{conc}_per_rpc"] = len(lat) / max(1, mc.batch_calls - calls0 + len(lat) - batched)
            out[f"create_{conc}_p50"] = _pct(lat, 0.5)
            out[f"create_{conc}_p99"] = _pct(lat, 0.99)
            slat: list[float] = []
            t0 = time.perf_counter()
            await asyncio.gather(*(_statter(mc, seconds, slat) for _ in range(conc)))
            out[f"stat_{conc}"] = len(slat) / (time.perf_counter() - t0)
            out[f"stat_{conc}_p50"] = _pct(slat, 0.5)
    return out


def run(quick: bool) -> dict[str, Any]:
    from tests.cluster import MetaCluster

    seconds = 2.0 if quick else 6.0
    with tempfile.TemporaryDirectory(prefix="bench-meta-") as td:
        tmp = Path(td)
        durable = _raw_cluster("durable", seconds, tmp)
        nofsync = _raw_cluster("nofsync", seconds, tmp)
        stock = _raw_cluster("memory", seconds, tmp)
        with MetaCluster(tmp / "svc", n=3, state_machine="meta") as c:
            c.wait_leader()
            pids = [r.proc.pid for r in c.replicas if r.proc is not None]
            svc = asyncio.run(_drive(c.addresses, seconds, pids))
        apply_us = _apply_us()

    def row(case: str, value: float, unit: str, base: float | None, base_name: str) -> dict[str, Any]:
        return {"case": case, "value": round(value, 4 if unit == "ms" else 1), "unit": unit,
                "baseline": None if base is None else round(base, 4 if unit == "ms" else 1),
                "baseline_name": base_name, "ratio": None if not base else round(value / base, 3)}

    ms = 1000.0
    rows = [
        row("create ops/s, 1 client", svc["create_1"], "ops/s", durable["seq_ops"], "raw pysyncobj + durable journal, 1 outstanding"),
        row("create ops/s, 16 clients", svc["create_16"], "ops/s", durable["conc_ops"], "raw pysyncobj + durable journal, 16 outstanding"),
        row("stat ops/s, 1 client (linearizable)", svc["stat_1"], "ops/s", durable["seq_ops"], "raw pysyncobj + durable journal, 1 outstanding"),
        row("stat ops/s, 16 clients (linearizable)", svc["stat_16"], "ops/s", durable["conc_ops"], "raw pysyncobj + durable journal, 16 outstanding"),
        row("create commit latency p50, 1 client", svc["create_1_p50"] * ms, "ms", durable["p50"] * ms, "raw pysyncobj + durable journal p50"),
        row("create commit latency p99, 1 client", svc["create_1_p99"] * ms, "ms", durable["p99"] * ms, "raw pysyncobj + durable journal p99"),
        row("create latency p50, 16 clients", svc["create_16_p50"] * ms, "ms", None, ""),
        row("create ops per Raft entry, 1 client", svc["create_1_per_entry"], "ops", None, ""),
        row("create ops per Raft entry, 16 clients (group commit)", svc["create_16_per_entry"], "ops", None, ""),
        row("create ops per RPC, 16 clients (Batch calls)", svc["create_16_per_rpc"], "ops", None, ""),
        row("CPU per create, 1 client: 3 replicas", svc["create_1_cpu_us"], "us",
            durable.get("seq_cpu_us"), "raw pysyncobj + durable journal, 3 replicas, per op, 1 outstanding"),
        row("CPU per create, 16 clients: 3 replicas", svc["create_16_cpu_us"], "us",
            durable.get("conc_cpu_us"), "raw pysyncobj + durable journal, 3 replicas, per op, 16 outstanding"),
        row("CPU per create, 1 client: the client process", svc["create_1_client_cpu_us"], "us", None, ""),
        row("CPU per create, 16 clients: the client process", svc["create_16_client_cpu_us"], "us", None, ""),
        row("state machine apply of one mkdir, x3 replicas", 3 * apply_us, "us",
            durable.get("conc_cpu_us"), "raw pysyncobj + durable journal, 3 replicas, per op, 16 outstanding"),
        row("raw pysyncobj + durable journal, 1 outstanding", durable["seq_ops"], "ops/s", stock["seq_ops"], "raw pysyncobj, stock in-memory journal"),
        row("raw pysyncobj + durable journal, 16 outstanding", durable["conc_ops"], "ops/s", stock["conc_ops"], "raw pysyncobj, stock in-memory journal"),
        row("raw pysyncobj + durable journal p50", durable["p50"] * ms, "ms", stock["p50"] * ms, "raw pysyncobj, stock in-memory journal p50"),
        row("raw pysyncobj + journal without fdatasync p50", nofsync["p50"] * ms, "ms", stock["p50"] * ms, "raw pysyncobj, stock in-memory journal p50"),
        row("raw pysyncobj + journal without fdatasync, 16 outstanding", nofsync["conc_ops"], "ops/s", stock["conc_ops"], "raw pysyncobj, stock in-memory journal"),
    ]
    notes = (
        "3 replicas, 3 processes on loopback, one machine; the client runs in the benchmark process. "
        "create = mkdir (one Raft commit, fdatasync on leader and followers); stat = read barrier "
        "(one shared no-op commit per batch of concurrent readers) + local read. Creates that wait together "
        "share one Raft entry (group commit; ops per entry is reported), and the creates that one MetaClient "
        "has waiting while 2 are in flight travel in one Batch call (ops per RPC is reported). Raw = bare pysyncobj "
        "counter with the same tuning (appendEntriesUseBatch=False), 3 processes; 'without fdatasync' "
        "isolates the cost of the disk flushes from the journal's CPU cost. CPU rows: user + system CPU "
        "seconds of the three replica processes (/proc) per committed op, for TierFS and for the raw counter "
        "in the same phases (their ratio is TierFS over raw: above 1 means TierFS spends more); 'apply x3' is "
        "one MetaStateMachine applying mkdirs in the benchmark process, times three replicas: CPU every "
        "create costs that the raw counter does not. All processes share this machine's cores, so when "
        "the run is CPU-bound, throughput ratio ~ raw CPU per op / TierFS CPU per op."
    )
    return {"name": "meta", "rows": rows, "notes": notes}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-node":
        a, peers, mode, d, secs = sys.argv[2:7]
        _raw_node(a, peers.split(","), mode, d, float(secs))
    else:
        print(json.dumps(run("--quick" in sys.argv), indent=2))
