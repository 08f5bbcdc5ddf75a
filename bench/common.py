"""Helpers more than one benchmark uses: a served KV pool, and the CPU time
of processes (to say where a benchmark's time went)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path


def create_kv_pool(meta: list[str], name: str, memory: int, *, disk: int | None = None,
                   timeout: float = 60.0, redundancy: str = "replica:1") -> None:
    """Define KV pool ``name`` (``memory`` bytes per target, ``disk`` or
    twice that on disk) and wait until every target of its groups serves it."""
    from tierfs.meta import MetaClient

    async def go() -> None:
        async with MetaClient(meta) as mc:
            await mc.create_kv_pool(name, target_memory=memory, target_disk=2 * memory if disk is None else disk,
                                    redundancy=redundancy)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                r = await mc.list_kv_pools()
                p = next((p for p in r.pools if p.name == name), None)
                if p is not None and p.groups:
                    members = {t for g in p.groups for t in g.target_ids}
                    if members <= {u.target_id for u in r.usage if u.pool_id == p.pool_id}:
                        return
                await asyncio.sleep(0.1)
        raise TimeoutError(f"KV pool {name} was not served within {timeout:g} s")

    asyncio.run(go())


def proc_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes used so far (/proc, Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


#: Prefill measured, not assumed: 4,096 tokens of a Llama-3-8B-shaped model
#: (random bf16 weights, transformers SDPA) on one H200, median of 5 runs
#: 121.0 ms (bench/gpu_kv.py on a GPU machine lent for stop 32,
#: bench/results/gpu_kv.md). The engine benchmarks report the TTFT saved at
#: this rate next to the stated 10-20k tokens/s of an H100.
MEASURED_PREFILL_TOK_S = 33_850
MEASURED_PREFILL_SOURCE = (
    "33,850 tokens/s was measured: a prefill of 4,096 tokens of a Llama-3-8B-shaped model (transformers, "
    "SDPA, bf16) on one H200 took 121.0 ms, median of 5 (bench/results/gpu_kv.md, stop 32)")


#: Set by ``python -m bench.run`` to the folder it writes to (its ``--out``),
#: so that the files a benchmark writes itself land beside its JSON.
RESULTS_ENV = "TIERFS_BENCH_RESULTS"


def results_dir(quick: bool) -> Path:
    """Where a benchmark writes its own extra files: bench.run's ``--out``
    (``$TIERFS_BENCH_RESULTS``) when it runs the benchmark, else
    bench/results, or bench/results/quick for a ``--quick`` run (whose short
    figures must not replace the committed full ones; bench.run writes there
    too)."""
    if os.environ.get(RESULTS_ENV):
        d = Path(os.environ[RESULTS_ENV])
    else:
        d = Path(__file__).resolve().parent / "results"
        d = d / "quick" if quick else d
    d.mkdir(parents=True, exist_ok=True)
    return d

