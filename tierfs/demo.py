"""``make run``: start a local cluster and show what works today.

Starts (or reuses) a local cluster under ``--data`` (3 meta replicas, 6
storage daemons), then: namespace operations through the Raft-replicated
metadata service; an ``ec:4+2``-encoded chunk written as six fragments to a
placement group's targets over the data plane and read back; SIGKILL of the
meta leader with the failover time measured and every acknowledged change
checked; replica digests compared. Stops the cluster at the end unless
``--keep``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import sys
import time

from tierfs.errors import TierFSError
from tierfs.local import LocalCluster


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    _say("    " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=False)))
    for r in rows:
        _say("    " + "  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=False)))


async def _leader(cl: LocalCluster) -> str:
    h = await cl.health()
    for m in h["meta"]:
        if m["role"] == "leader":
            return str(m["name"])
    raise TierFSError("no meta leader")


async def demo(cl: LocalCluster) -> None:
    from pyeclib.ec_iface import ECDriver

    from tierfs.meta import MetaClient
    from tierfs.net import DataClient
    from tierfs.storage.api import FragmentKey

    h = await cl.wait_healthy(60)
    _table([[m["name"], m["addr"], m["role"], str(m["pid"])] for m in h["meta"]],
           ["meta", "gRPC address", "role", "pid"])
    _table([[s["name"], s["addr"], s["state"], str(s["node_id"]), ",".join(map(str, s["targets"]))]
            for s in h["storage"]], ["storage", "data-plane address", "state", "node", "targets"])
    _say(f"    placement groups: {h['groups']} (cluster map version {h['map_version']})")

    async with MetaClient(cl.meta_addrs) as mc:
        _say("\n[2/4] Namespace through the Raft-replicated metadata service")
        with contextlib.suppress(FileExistsError):
            await mc.mkdir("/demo")
        run = f"/demo/run-{int(time.time())}"
        await mc.mkdir(run)
        n = 200
        t0 = time.perf_counter()
        for i in range(n):
            await mc.create(f"{run}/step-{i:04d}")
        dt = time.perf_counter() - t0
        _say(f"    created {n} files in {run}: {n / dt:,.0f} creates/s, {dt / n * 1e3:.2f} ms each "
             "(each durable on a majority before it returns)")
        await mc.rename(f"{run}/step-0000", f"{run}/renamed")
        names = [e.name async for e in mc.iterdir(run)]
        _say(f"    ls {run}: {len(names)} entries, e.g. {', '.join(sorted(names)[:3])} ...")
        try:
            await mc.mkdir(f"{run}/bad/../name")
        except TierFSError as exc:
            _say(f"    bad input is refused and changes nothing: {type(exc).__name__}: {exc}")

        _say("\n[3/4] An ec:4+2 chunk over the data plane")
        cmap = await mc.get_cluster_map()
        group = next(g for g in cmap.groups if g.width == 6)
        node_of = {t.target_id: t.node_id for t in cmap.targets}
        addr_of = {nd.node_id: nd.data_addr for nd in cmap.nodes}
        ec = ECDriver(k=4, m=2, ec_type="isa_l_rs_cauchy")
        chunk = os.urandom(4 << 20)
        frags = ec.encode(chunk)
        info = await mc.create(f"{run}/chunk.bin")
        inode = info.attr.inode
        dc = DataClient(routes={t: addr_of[node_of[t]] for t in group.target_ids})
        try:
            t0 = time.perf_counter()
            res = await dc.write_batch([(t, FragmentKey(inode, 0, j, 1), frags[j])
                                        for j, t in enumerate(group.target_ids)])
            wdt = time.perf_counter() - t0
            assert all(r is None for r in res), res
            bufs = [bytearray(len(frags[j])) for j in range(4)]
            t0 = time.perf_counter()
            got = await dc.read_batch([(group.target_ids[j], FragmentKey(inode, 0, j, 1), memoryview(bufs[j]), 0)
                                       for j in range(4)])
            rdt = time.perf_counter() - t0
            ok = ec.decode([bytes(b) for b in bufs]) == chunk
            _say(f"    group {group.group_id} targets {list(group.target_ids)} (each on a distinct node)")
            _say(f"    wrote 6 fragments of {len(frags[0]):,} B in {wdt * 1e3:.1f} ms (fsynced on every target); "
                 f"read the 4 data fragments back in {rdt * 1e3:.1f} ms: "
                 f"{'identical' if ok and all(isinstance(g, int) for g in got) else 'MISMATCH'} "
                 f"(sha256 {hashlib.sha256(chunk).hexdigest()[:16]})")
            # Decode around a lost fragment: drop data fragment 0, use parity 4.
            parity = bytearray(len(frags[4]))
            await dc.read_into(group.target_ids[4], FragmentKey(inode, 0, 4, 1), memoryview(parity))
            again = ec.decode([bytes(b) for b in bufs[1:]] + [bytes(parity)])
            _say(f"    without data fragment 0 (decoded from parity): {'identical' if again == chunk else 'MISMATCH'}")
        finally:
            await dc.close()

        _say("\n[4/4] SIGKILL the meta leader")
        old = await _leader(cl)
        cl.kill(old)
        t0 = time.perf_counter()
        await mc.create(f"{run}/after-failover")
        _say(f"    killed {old}; the next create succeeded after {time.perf_counter() - t0:.2f} s "
             f"(new leader: {await _leader(cl)})")
        present = {e.name async for e in mc.iterdir(run)}
        missing = [f"step-{i:04d}" for i in range(1, n) if f"step-{i:04d}" not in present]
        _say(f"    acknowledged entries missing after failover: {len(missing)}")
        cl.start(names=[old])
        deadline = time.monotonic() + 20
        while True:
            digests = {}
            for m in cl.meta_addrs:
                d = await mc.digest(addr=m)
                digests[m] = (d.digest, d.applied_index)
            if len({d[0] for d in digests.values()}) == 1 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        same = len({d[0] for d in digests.values()}) == 1
        _say(f"    restarted {old}; replica state digests {'identical' if same else 'DIFFER'}: "
             f"{next(iter(digests.values()))[0][:16]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="./.tierfs", help="cluster directory (default ./.tierfs)")
    ap.add_argument("--keep", action="store_true", help="leave the cluster running afterwards")
    ns = ap.parse_args(argv)
    cl = LocalCluster(ns.data)
    _say(f"[1/4] Starting a local cluster in {cl.dir} (3 meta replicas, 6 storage daemons)")
    t0 = time.perf_counter()
    started = cl.start()
    _say(f"    {'started ' + str(len(started)) + ' daemons' if started else 'reusing the running cluster'} "
         f"in {time.perf_counter() - t0:.1f} s")
    rc = 0
    try:
        asyncio.run(demo(cl))
    except (TierFSError, AssertionError) as exc:
        _say(f"demo failed: {type(exc).__name__}: {exc}")
        rc = 1
    finally:
        if ns.keep:
            _say(f"\nThe cluster keeps running. Meta: {','.join(cl.meta_addrs)}")
            _say(f"Stop it with: .venv/bin/python -m tierfs.local down --data {ns.data}")
        else:
            cl.stop()
            _say(f"\nStopped the cluster; its data stays in {cl.dir} (the next `make run` reuses it).")
    return rc


if __name__ == "__main__":
    sys.exit(main())
