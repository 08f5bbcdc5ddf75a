"""KV replica gets with and without the copy check (``kv_verify_copies``).

Since stop 39 a get from a replica pool asks the next copy for the key's
stored CRC32C alongside the read (one ``KV_EXISTS`` with ``KV_WITH_CRC``
per target per batch; docs/kv.md, "Forged copies"). This measures what
that costs: a ``replica:2`` memory pool on a local cluster (1 meta, 2
storage daemons, tcp on loopback), one client, the same gets with the
check on and off in alternating rounds. The baseline is the check off (a
get as it was before). Cases: ``get_into`` of one 64 KiB and one 1 MiB
object at a time (gets/s), and ``batch_get_into`` of 32 objects of 64 KiB
(batches/s). Medians over the rounds.

    python -m bench.run --only kv_copies [--quick]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import create_kv_pool

KiB, MiB = 1 << 10, 1 << 20


async def _rate(kv: Any, case: str, keys: list[bytes], bufs: list[bytearray], seconds: float,
                forget: bool = False) -> float:
    """Operations per second of ``case`` for ``seconds``; every answer
    must be a hit of the right size (a miss would measure nothing).
    ``forget``: the client forgets the CRC32Cs it knows before each get, so
    that every get asks its witness (a client's first get of a key)."""
    n, t0 = 0, time.perf_counter()
    i = 0
    while time.perf_counter() - t0 < seconds:
        if forget:
            kv.cluster._known.clear()
        if case == "batch":
            got = await kv.batch_get_into(keys, bufs)
            if any(g != len(b) for g, b in zip(got, bufs, strict=True)):
                raise RuntimeError(f"batch_get_into missed: {got}")
        else:
            k = keys[i % len(keys)]
            got = await kv.get_into(k, bufs[0])
            if got != len(bufs[0]):
                raise RuntimeError(f"get_into of {k!r} answered {got}")
        n += 1
        i += 1
    return n / (time.perf_counter() - t0)


def run(quick: bool) -> dict[str, Any]:
    from tierfs.client import AsyncClient
    from tierfs.local import LocalCluster

    rounds, seconds = (3, 1.0) if quick else (6, 2.0)
    cases = [("get_into 64 KiB", "single", 64 * KiB, 64), ("get_into 1 MiB", "single", MiB, 16),
             ("batch_get_into 32 x 64 KiB", "batch", 64 * KiB, 32)]
    with tempfile.TemporaryDirectory(prefix="bench-kv-copies-") as tmp:
        cl = LocalCluster(Path(tmp) / "c", n_meta=1, n_storage=2)
        cl.up(timeout=120)
        try:
            cl.export_token()  # security on: this cluster's admin token
            create_kv_pool(cl.meta_addrs, "copies", 256 * MiB, disk=512 * MiB, redundancy="replica:2")

            async def go() -> dict[str, dict[str, list[float]]]:
                out: dict[str, dict[str, list[float]]] = {}
                async with AsyncClient(cl.meta_addrs) as on, AsyncClient(cl.meta_addrs, kv_verify_copies=False) as off:
                    kvs = {"on": on.kv_pool("copies"), "off": off.kv_pool("copies")}
                    for name, case, size, count in cases:
                        keys = [f"{name}-{i}".encode() for i in range(count)]
                        for k in keys:
                            await kvs["on"].put(k, os.urandom(size), overwrite=True)
                        bufs = [bytearray(size) for _ in range(count if case == "batch" else 1)]
                        res: dict[str, list[float]] = {"on": [], "first": [], "off": []}
                        ways = {"on": ("on", False), "first": ("on", True), "off": ("off", False)}
                        for _ in range(2):  # warm both clients (maps, connections)
                            for w in ("off", "on"):
                                await _rate(kvs[w], case, keys, bufs, 0.2)
                        for r in range(rounds):
                            order = ["off", "on", "first"]
                            for w in order[r % 3:] + order[:r % 3]:
                                client, forget = ways[w]
                                res[w].append(await _rate(kvs[client], case, keys, bufs, seconds, forget))
                        out[name] = res
                    st = kvs["on"].cluster.counters
                    out["_counts"] = {"unwitnessed": [float(st.unwitnessed)],
                                      "disagreements": [float(st.disagreements)]}
                return out

            got = asyncio.run(go())
        finally:
            cl.stop()
    counts = got.pop("_counts")
    rows = []
    labels = {"on": "copy check on, CRC32C known (repeat gets)",
              "first": "copy check on, witness asked (first get of a key)"}
    for name, res in got.items():
        off = statistics.median(res["off"])
        for w, label in labels.items():
            v = statistics.median(res[w])
            rows.append({"case": f"{name}, {label}", "value": round(v, 1),
                         "unit": "batches/s" if name.startswith("batch") else "gets/s",
                         "baseline": round(off, 1), "baseline_name": "copy check off (before stop 39)",
                         "ratio": v / off if off else None,
                         "rounds": [round(x, 1) for x in res[w]], "baseline_rounds": [round(x, 1) for x in res["off"]]})
    notes = (f"replica:2 memory pool, 1 meta + 2 storage daemons on loopback (tcp), one client; {rounds} "
             f"rounds of {seconds:g} s per case and way, the order rotated each round, medians. \"CRC32C "
             "known\": the client put the keys (or read them once), so a copy with that CRC32C needs no "
             "witness; \"witness asked\": the client forgets before each get, so every get asks the next "
             f"copy alongside. Hits the check could not vouch for: {counts['unwitnessed'][0]:.0f}; copies "
             f"that disagreed: {counts['disagreements'][0]:.0f} (both should be 0 here).")
    return {"name": "kv_copies", "rows": rows, "notes": notes}


if __name__ == "__main__":
    import json

    print(json.dumps(run(quick=True), indent=2))
