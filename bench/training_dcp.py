"""PyTorch Distributed Checkpoint save and load of a ~1 GiB state dict with 4
ranks: TierFS (tierfs.integrations.torch_dcp) against DCP's own
FileSystemWriter / FileSystemReader on local disk, in the same run.

The benchmark starts its own cluster (``tierfs.local.LocalCluster``: 1 meta,
6 storage daemons, the default ``ec:4+2`` layout) and 4 rank processes in a
gloo group on loopback, each with its own TierFS client. The state dict is
16 tensors (half float32, half bfloat16) sharded along dim 0 over the 4 ranks
as DTensors (``DTensor.from_local``: no rank ever holds a full tensor), plus
a few non-tensor items. Per round, each rank:

1. saves through ``TierFSStorageWriter`` (durable when it returns: every
   fragment fsynced by its storage target, ``.metadata`` committed last);
2. loads it into zeroed tensors through ``TierFSStorageReader`` (checked
   bit-identical on the first round);
3. saves through ``FileSystemWriter(sync_files=True)`` (fsync of every file)
   to a local directory, with the same ``thread_count``;
4. drops the local files from the page cache (``posix_fadvise DONTNEED``
   after the fsync) and loads them through ``FileSystemReader``.

Times are from a barrier before to a barrier after each step (the slowest
rank); GB/s is the state dict's bytes over that. Rows: save and load GB/s,
the local figures as baselines, and the ratio. Writes
``bench/results/training_dcp.{json,md}`` (``--quick``: ``bench/results/quick/``).

    python -m bench.training_dcp [--quick] [--mib 1024] [--reps 2] [--threads 4]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import results_dir

MiB = 1 << 20
N_TENSORS = 16
COLS = 4096


def _state(rank: int, world: int, mib: int, mesh: Any) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor, Shard

    g = torch.Generator().manual_seed(1000 + rank)
    per_tensor = mib * MiB // N_TENSORS  # bytes of one full tensor
    sd: dict[str, Any] = {}
    for i in range(N_TENSORS):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        rows = max(world, per_tensor // (COLS * dtype.itemsize)) // world * world
        local = torch.randn(rows // world, COLS, generator=g).to(dtype)
        sd[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                      shape=torch.Size([rows, COLS]),
                                                      stride=(COLS, 1))
    sd["step"] = 1000
    sd["config"] = {"lr": 3e-4, "name": "bench"}
    return sd


def _nbytes(sd: dict[str, Any]) -> int:
    import torch

    return sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))


def _zeroed(sd: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    for k, v in b.items():
        if isinstance(v, torch.Tensor):
            x, y = a[k].to_local(), v.to_local()
            if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                return False
    return True


def _evict(path: Path) -> None:
    """Drop a directory's (fsynced) files from the page cache."""
    for p in path.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def worker(rank: int, world: int, port: int, mib: int, reps: int, threads: int, local_dir: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import init_device_mesh

    from tierfs.client import Client
    from tierfs.integrations.torch_dcp import TierFSStorageReader, TierFSStorageWriter

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    sd = _state(rank, world, mib, mesh)
    total = _nbytes(sd)  # a DTensor's numel is the full tensor's
    times: dict[str, list[float]] = {"tierfs_save": [], "tierfs_load": [], "local_save": [], "local_load": []}
    stats: Any = None

    @contextlib.contextmanager
    def timed(key: str) -> Iterator[None]:
        dist.barrier()
        t0 = time.perf_counter()
        yield
        dist.barrier()
        times[key].append(time.perf_counter() - t0)

    with Client() as c:
        for r in range(reps):
            path = f"/bench-dcp/ckpt-{r % 2}"
            w = TierFSStorageWriter(path, client=c, thread_count=threads)
            with timed("tierfs_save"):
                dcp.save(sd, storage_writer=w)
            dest = _zeroed(sd)
            rd = TierFSStorageReader(path, client=c)
            with timed("tierfs_load"):
                dcp.load(dest, storage_reader=rd)
            stats = rd.stats
            if r == 0 and not _equal(dest, sd):
                raise SystemExit(f"rank {rank}: the TierFS checkpoint did not load back bit-identical")
            del dest
            local = Path(local_dir) / f"ckpt-{r}"
            with timed("local_save"):
                dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(local), sync_files=True, thread_count=threads))
            if rank == 0:
                _evict(local)
            dest = _zeroed(sd)
            with timed("local_load"):
                dcp.load(dest, storage_reader=dcp.FileSystemReader(str(local)))
            if r == 0 and not _equal(dest, sd):
                raise SystemExit(f"rank {rank}: the local checkpoint did not load back bit-identical")
            del dest
            dist.barrier()
            if rank == 0:
                shutil.rmtree(local, ignore_errors=True)
    if rank == 0:
        print("RESULT " + json.dumps({"bytes": total, "times": times, "read_stats": vars(stats)}), flush=True)
    dist.destroy_process_group()


def _gbs(nbytes: int, secs: list[float]) -> float:
    return round(nbytes / min(secs) / 1e9, 3)


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# DCP save/load: TierFS vs local disk ({res['bytes'] / MiB:.0f} MiB, {res['ranks']} ranks)", "",
             f"`{res['command']}` on {res['machine']}; {res['notes']}", "",
             "| case | TierFS | local (FileSystemWriter/Reader) | ratio |", "| --- | --- | --- | --- |"]
    for row in res["rows"]:
        lines.append(f"| {row['case']} | {row['value']} {row['unit']} | {row['baseline']} {row['unit']} | "
                     f"{row['ratio']} |")
    lines += ["", f"TierFS reader, tensors placed (rank 0): {res['read_stats']}"]
    lines += ["", "Seconds per round (slowest rank, barrier to barrier):", ""]
    for k, v in res["times"].items():
        lines.append(f"- {k}: {', '.join(f'{s:.2f}' for s in v)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MiB, one round: checks that it runs")
    ap.add_argument("--mib", type=int, default=1024, help="state dict size in MiB (all ranks)")
    ap.add_argument("--reps", type=int, default=2, help="rounds; the best one is reported")
    ap.add_argument("--threads", type=int, default=4, help="files each rank writes at once (both writers)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--worker", nargs=3, metavar=("RANK", "PORT", "LOCAL_DIR"), help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.mib, ns.reps = 64, 1
    if ns.worker:
        worker(int(ns.worker[0]), ns.ranks, int(ns.worker[1]), ns.mib, ns.reps, ns.threads, ns.worker[2])
        return 0

    from tierfs.local import LocalCluster, free_ports

    tmp = Path(tempfile.mkdtemp(prefix="bench-dcp-"))
    cluster = LocalCluster(tmp / "cluster", n_meta=1, n_storage=6)
    cluster.export_token()  # security on: this cluster's admin token
    procs: list[subprocess.Popen[str]] = []
    try:
        cluster.up(timeout=120)
        env = {**os.environ, "TIERFS_META": ",".join(cluster.meta_addrs)}
        port = free_ports(1)[0]
        (tmp / "local").mkdir()
        args = ["--mib", str(ns.mib), "--reps", str(ns.reps), "--threads", str(ns.threads),
                "--ranks", str(ns.ranks)]
        procs = [subprocess.Popen([sys.executable, "-m", "bench.training_dcp", *args, "--worker", str(r), str(port),
                                   str(tmp / "local")], env=env, stdout=subprocess.PIPE, text=True)
                 for r in range(ns.ranks)]
        outs = [p.communicate(timeout=3600)[0] for p in procs]
        if any(p.returncode for p in procs):
            for r, (p, out) in enumerate(zip(procs, outs, strict=True)):
                print(f"rank {r} exited {p.returncode}:\n{out[-3000:]}", file=sys.stderr)
            return 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    line = next(x for x in outs[0].splitlines() if x.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    nbytes, t = got["bytes"], got["times"]
    rows = []
    for op, base in (("save", "FileSystemWriter, local disk, sync_files=True"),
                     ("load", "FileSystemReader, local disk, page cache dropped")):
        v, b = _gbs(nbytes, t[f"tierfs_{op}"]), _gbs(nbytes, t[f"local_{op}"])
        rows.append({"case": f"DCP {op}, {ns.ranks} ranks, {nbytes / MiB:.0f} MiB", "value": v, "unit": "GB/s",
                     "baseline": b, "baseline_name": base, "ratio": round(v / b, 3) if b else None})
    res = {"name": "training_dcp", "rows": rows, "bytes": nbytes, "ranks": ns.ranks, "reps": ns.reps,
           "threads": ns.threads, "times": t, "read_stats": got["read_stats"],
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
           "command": "python -m bench.training_dcp " + " ".join(argv if argv is not None else sys.argv[1:]),
           "notes": (f"cluster: 1 meta + 6 storage daemons on this machine, ec:4+2; {ns.threads} files per rank "
                     f"written at once by both writers; best of {ns.reps} round(s)")}
    out = results_dir(ns.quick)  # a --quick run's figures go to results/quick, not over the full ones
    (out / "training_dcp.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "training_dcp.md").write_text(markdown(res))
    print(markdown(res))
    return 0


def run(quick: bool) -> dict[str, Any]:
    """The bench/run.py entry: runs the benchmark, returns its results."""
    if main(["--quick"] if quick else []) != 0:
        raise RuntimeError("bench.training_dcp failed")
    result: dict[str, Any] = json.loads((results_dir(quick) / "training_dcp.json").read_text())
    return result


if __name__ == "__main__":
    sys.exit(main())
