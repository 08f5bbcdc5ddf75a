"""Loading a ~1 GiB safetensors file: ``tierfs.integrations.safetensors.load_file``
from TierFS against ``safetensors.torch.load_file`` from local disk, in the
same run. Runs in the engines venv (torch, safetensors).

The file: the layers of a fake 0.5B-parameter decoder (the shapes of
Qwen2-0.5B: 24 layers, hidden 896, MLP 4864, a 151,936-token embedding),
written by ``safetensors.torch.save_file`` to the local disk; weights bf16,
norms f32, attention biases f16, plus an i64 position table and a bool mask,
0.99 GB in all (quick: 2 layers and a 16,384-token embedding, 92 MB). The
same bytes are copied into TierFS (one ``ec:4+2`` directory, 4 MiB chunks,
6 storage daemons and 1 meta replica of a ``tierfs.local.LocalCluster``).

Measured, ``--reps`` times each, interleaved (median reported, every run in
the JSON):

* **TierFS:** ``load_file(client, path)`` with a blocking ``Client``
  (connected before the timing): the header by one ranged read, every
  tensor read in parallel into its own fresh tensor.
* **local disk, cold:** ``safetensors.torch.load_file`` of the local file
  after ``posix_fadvise(POSIX_FADV_DONTNEED)`` on it (the file is fsynced
  and no mapping of it is alive, so its pages do leave the page cache;
  ``fincore`` confirms it before each run and the notes give the largest
  residue). The library maps the file, so its tensors can fault their
  pages in lazily, after ``load_file`` has returned (one 128 MiB tensor's
  ``load_file`` returned in 15 ms here with the file out of the cache). So
  on *both* sides the time is ``load_file`` plus touching every 4 KiB page
  of every tensor (one byte a page): the time until all the weights are in
  memory. ``load_file``'s own return time is in the JSON and the notes.
* **local disk, warm:** the same right after the cold run, with the file in
  the page cache (the best a local disk can do).

The first run checks that both loads give the same keys, dtypes, shapes
and bytes as the tensors saved (untimed). Writes
``bench/results/training_safetensors.{json,md}`` (``--quick``:
``bench/results/quick/``).

    python -m bench.training_safetensors [--quick] [--reps 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from bench.common import results_dir
from bench.run import to_markdown
from tierfs.client import Client
from tierfs.integrations.safetensors import load_file
from tierfs.local import LocalCluster

MiB = 1 << 20
PAGE = 4096
PIECE = 64 * MiB


def fake_model(layers: int, vocab: int, hidden: int = 896, mlp: int = 4864, kv: int = 128) -> dict[str, torch.Tensor]:
    """Random tensors shaped like a small decoder's; random bits, so any byte slip shows."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
        info = torch.iinfo(bits)
        return torch.randint(info.min, info.max, shape, generator=g, dtype=bits).view(dtype)

    bf = torch.bfloat16
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(vocab, hidden, dtype=bf)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": rnd(hidden, dtype=torch.float32),
            p + "self_attn.q_proj.weight": rnd(hidden, hidden, dtype=bf),
            p + "self_attn.q_proj.bias": rnd(hidden, dtype=torch.float16),
            p + "self_attn.k_proj.weight": rnd(kv, hidden, dtype=bf),
            p + "self_attn.k_proj.bias": rnd(kv, dtype=torch.float16),
            p + "self_attn.v_proj.weight": rnd(kv, hidden, dtype=bf),
            p + "self_attn.v_proj.bias": rnd(kv, dtype=torch.float16),
            p + "self_attn.o_proj.weight": rnd(hidden, hidden, dtype=bf),
            p + "post_attention_layernorm.weight": rnd(hidden, dtype=torch.float32),
            p + "mlp.gate_proj.weight": rnd(mlp, hidden, dtype=bf),
            p + "mlp.up_proj.weight": rnd(mlp, hidden, dtype=bf),
            p + "mlp.down_proj.weight": rnd(hidden, mlp, dtype=bf),
        }
    t |= {
        "model.norm.weight": rnd(hidden, dtype=torch.float32),
        "model.rotary.position_ids": torch.arange(32768, dtype=torch.int64),
        "model.attention_mask": rnd(1024, 1024, dtype=torch.bool),
    }
    return t


def touch(tensors: dict[str, torch.Tensor]) -> int:
    """Read one byte of every page of every tensor (so a lazily mapped one is
    really in memory); returns a sum so the reads cannot be skipped."""
    s = 0
    for t in tensors.values():
        if t.numel() == 0:
            continue
        b = t.reshape(-1).view(torch.uint8)
        s += int(b[::PAGE].sum()) + int(b[-1])
    return s


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    if sorted(a) != sorted(b):
        raise AssertionError(f"{what}: keys differ")
    for k, x in a.items():
        y = b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            raise AssertionError(f"{what}: {k}: {y.dtype}{list(y.shape)}, expected {x.dtype}{list(x.shape)}")
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            raise AssertionError(f"{what}: {k}: bytes differ")


def cached(path: Path) -> int:
    """Bytes of ``path`` in the page cache (fincore); -1 without fincore."""
    if shutil.which("fincore") is None:
        return -1
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def drop_cache(path: Path) -> int:
    """Evict ``path``'s (clean, unmapped) pages; what is left in the cache."""
    gc.collect()  # tensors of a previous load still map the file: their pages would stay
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return cached(path)


def upload(c: Client, local: Path, path: str) -> None:
    with open(local, "rb") as src, c.open(path, "wb") as f:
        while piece := src.read(PIECE):
            f.write(piece)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 layers, a 92 MB file")
    ap.add_argument("--reps", type=int, default=3)
    ns = ap.parse_args()
    layers, vocab = (2, 16384) if ns.quick else (24, 151936)
    tensors = fake_model(layers, vocab)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    count = len(tensors)
    tmp = Path(tempfile.mkdtemp(prefix="bench-safetensors-", dir=os.environ.get("TIERFS_BENCH_DIR")))
    local = tmp / "model.safetensors"
    runs: dict[str, list[float]] = {"tierfs": [], "cold": [], "warm": [], "cold_returned": []}
    residue = 0
    cluster = LocalCluster(tmp / "cluster", n_meta=1, n_storage=6)
    cluster.export_token()  # security on: this cluster's admin token
    try:
        safetensors.torch.save_file(tensors, str(local))
        fd = os.open(local, os.O_RDONLY)
        try:
            os.fsync(fd)  # DONTNEED drops only clean pages
        finally:
            os.close(fd)
        size = local.stat().st_size
        t0 = time.monotonic()
        cluster.up(timeout=120)
        start_s = time.monotonic() - t0
        with Client(cluster.meta_addrs) as c:
            c.mkdir("/models", exist_ok=True)
            c.set_layout("/models", chunk_size=4 * MiB, redundancy="ec:4+2")
            path = "/models/model.safetensors"
            upload(c, local, path)
            if c.stat(path).size != size:
                raise AssertionError(f"{path}: {c.stat(path).size} bytes in TierFS, {size} on disk")
            c.read_into(path, bytearray(16 * 4 * MiB))  # connections to the daemons, untimed
            for rep in range(ns.reps):
                for side in (("tierfs", "local") if rep % 2 == 0 else ("local", "tierfs")):
                    if side == "tierfs":
                        t0 = time.perf_counter()
                        got = load_file(c, path)
                        touch(got)
                        runs["tierfs"].append(time.perf_counter() - t0)
                        if rep == 0:
                            same(tensors, got, "tierfs load_file")
                        del got
                        continue
                    residue = max(residue, drop_cache(local))
                    t0 = time.perf_counter()
                    got = safetensors.torch.load_file(str(local))
                    runs["cold_returned"].append(time.perf_counter() - t0)
                    touch(got)
                    runs["cold"].append(time.perf_counter() - t0)
                    del got
                    gc.collect()
                    t0 = time.perf_counter()  # the file is in the page cache now
                    got = safetensors.torch.load_file(str(local))
                    touch(got)
                    runs["warm"].append(time.perf_counter() - t0)
                    if rep == 0:
                        same(tensors, got, "safetensors.torch.load_file")
                    del got
                    gc.collect()
                if rep == 0:
                    tensors.clear()  # checked against: 1 GB less in memory for the later runs
    finally:
        cluster.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in runs.items()}
    gbps = {k: size / v / 1e9 for k, v in med.items()}
    cold_name = "safetensors.torch.load_file, local disk, page cache dropped"
    warm_name = "safetensors.torch.load_file, local disk, warm page cache"

    def row(case: str, value: float, unit: str, base: float, name: str, r: list[float], br: list[float]) -> dict[str, Any]:
        return {"case": case, "value": round(value, 3), "unit": unit, "baseline": round(base, 3),
                "baseline_name": name, "ratio": round(value / base, 3) if base else None,
                "runs": [round(x, 4) for x in r], "baseline_runs": [round(x, 4) for x in br]}

    label = f"{size / 1e9:.2f} GB, {count} tensors"
    rows = [
        row(f"load_file from TierFS ec:4+2 ({label})", gbps["tierfs"], "GB/s", gbps["cold"], cold_name,
            [size / x / 1e9 for x in runs["tierfs"]], [size / x / 1e9 for x in runs["cold"]]),
        row(f"load_file from TierFS ec:4+2 ({label}) vs warm cache", gbps["tierfs"], "GB/s", gbps["warm"],
            warm_name, [size / x / 1e9 for x in runs["tierfs"]], [size / x / 1e9 for x in runs["warm"]]),
        row("load time, TierFS (lower is better)", med["tierfs"], "s", med["cold"], cold_name,
            runs["tierfs"], runs["cold"]),
        row("load time, TierFS vs warm cache (lower is better)", med["tierfs"], "s", med["warm"], warm_name,
            runs["tierfs"], runs["warm"]),
    ]
    notes = (
        f"fake 0.5B decoder ({layers} layers, vocab {vocab:,}; dtypes {', '.join(dtypes)}), {size:,} bytes "
        f"written by safetensors {safetensors.__version__}; median of {ns.reps} runs per side, interleaved; "
        "time = load_file + one byte read from every 4 KiB page of every tensor (safetensors' tensors map the "
        f"file and may fault pages in lazily: its load_file alone returned in {med['cold_returned'] * 1000:.1f} "
        "ms cold); TierFS: "
        "1 meta + 6 storage daemons on this host, loopback TCP, daemons read with O_DIRECT; cold local runs "
        "after posix_fadvise(DONTNEED) on the fsynced file, "
        + (f"at most {residue / MiB:.1f} MiB of it left in the page cache (fincore)" if residue >= 0 else
           "residue not measured (no fincore)")
        + f"; both loads equal the saved tensors (bytes, dtypes, shapes); cluster start {start_s:.1f} s; "
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    res: dict[str, Any] = {
        "name": "training_safetensors", "rows": rows, "notes": notes,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "quick": ns.quick,
        "command": "python -m bench.training_safetensors " + " ".join(sys.argv[1:]),
        "bytes": size, "tensor_bytes": nbytes, "tensors": count, "dtypes": dtypes,
        "load_returned_cold_s": [round(x, 4) for x in runs["cold_returned"]],
    }
    out = results_dir(ns.quick)  # a --quick run's figures go to results/quick, not over the full ones
    (out / "training_safetensors.json").write_text(json.dumps(res, indent=1) + "\n")
    md = ("# safetensors: loading a ~1 GiB file (bench/training_safetensors.py)\n\n"
          f"`{res['command'].strip()}`, {res['when']}{' (quick)' if ns.quick else ''}\n\n" + to_markdown(res))
    (out / "training_safetensors.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
