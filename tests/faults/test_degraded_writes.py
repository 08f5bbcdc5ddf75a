"""Degraded writes, for real: a storage daemon of six is SIGKILLed, so every
ec:4+2 group (each spans all six nodes) lacks a member and none can be
replaced.

What it proves: writes keep working while the node is down (a chunk needs
K+1 = 5 durable fragments; the position whose target the map shows offline
is skipped, not retried) and the commit records the position not stored in
the chunk's record (``missing``); the new generation reads back exactly,
never the stale fragment of the older generation the returning node still
holds; the restarted node's repair-queue worker rebuilds the fragments it
missed at once, unasked, byte for byte, and meta's records show them whole
again; a scrub then finds nothing; and afterwards every chunk survives the
loss of any two other nodes (checked by decoding each chunk from every
4-of-6 subset that keeps the caught-up node, then by really killing two
other daemons).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import pytest

from tests.faults.harness import FaultCluster, Ledger, MiB, digest, random_bytes, wait_node_state
from tierfs.cli.repair import _control, scrub_cluster
from tierfs.client import AsyncClient
from tierfs.client.client import FileView
from tierfs.client.codec import Codec
from tierfs.errors import NotFoundError, UnavailableError
from tierfs.meta import MetaClient
from tierfs.proto.v1 import storage_control_pb2 as spb
from tierfs.storage.api import FragmentKey

DOWN = "storage-3"


async def _fragments(meta: list[str], path: str, down_addr: str) -> tuple[list[dict[int, bytes]], list[int], int]:
    """Per chunk of ``path``: position -> stored payload (absent ones left
    out); the position of the ``down_addr`` node's target; the K."""
    async with AsyncClient(meta, request_timeout=3.0) as ac:
        view = FileView.of(path, await ac.meta.stat(path))
        cmap = await ac.meta.get_cluster_map()
        node = next(n.node_id for n in cmap.nodes if n.data_addr == down_addr)
        on_node = {t.target_id for t in cmap.targets if t.node_id == node}
        _, data, router = ac._parts()
        chunks: list[dict[int, bytes]] = []
        pos: list[int] = []
        for idx in range(-(-view.size // view.chunk_size)):
            rec = view.record(idx)
            assert rec is not None
            ver = rec.generation
            targets = await router.targets(view.groups[idx % len(view.groups)])
            pos.append(next(j for j, t in enumerate(targets) if t in on_node))
            got: dict[int, bytes] = {}
            for j, t in enumerate(targets):
                with contextlib.suppress(NotFoundError, UnavailableError):  # absent, or its node down
                    got[j] = await data.read(t, FragmentKey(view.inode, idx, j, ver))
            chunks.append(got)
        return chunks, pos, view.codec.k


async def _missing(meta: list[str], paths: list[str]) -> dict[str, list[tuple[int, ...]]]:
    """Per file, each chunk's record's missing positions (from meta)."""
    async with MetaClient(meta, deadline=10.0) as mc:
        return {p: [tuple(r.missing) for r in (await mc.stat(p)).chunks] for p in paths}


async def _queue_rebuilt(meta: list[str]) -> int:
    """Fragments the nodes' repair-queue workers rebuilt, summed."""
    total = 0
    async with MetaClient(meta, deadline=10.0) as mc:
        for n in (await mc.get_cluster_map()).nodes:
            total += (await _control(n.control_addr, "RepairStatus", spb.RepairStatusRequest(), 5.0)).queue_rebuilt
    return total


@pytest.mark.timeout(90)
def test_degraded_write_then_repair_queue_catches_up(tmp_path_factory: pytest.TempPathFactory) -> None:
    # No background scrub: the restarted daemon's repair-queue worker alone
    # must catch up (docs/repair.md).
    fc = FaultCluster(tmp_path_factory.mktemp("degraded"), extra_storage_args=("--scrub-rate=0",))
    try:
        meta = fc.meta_addrs
        down_addr = fc.cl.proc(DOWN).addr
        ledger = Ledger()
        with fc.client(request_timeout=1.0, retries=2) as client:
            client.mkdir("/dw")
            client.set_layout("/dw", chunk_size=MiB)
            old = random_bytes(3 * MiB, seed=1)
            assert ledger.write(client, "/dw/f", old)
            fc.cl.kill(DOWN)
            wait_node_state(fc.cl, DOWN, "offline", timeout=30)
            # A rewrite of /dw/f and a new file /dw/g: with every group spanning
            # the down node, meta places the new file on groups that can take
            # a degraded write.
            new = {"/dw/f": random_bytes(3 * MiB, seed=2), "/dw/g": random_bytes(4 * MiB, seed=3)}
            t0 = time.monotonic()
            for p, b in new.items():
                assert ledger.write(client, p, b), ledger.errors
            took = time.monotonic() - t0
            degraded = client.aclient.degraded_writes
            print(f"\n7 chunks written with {DOWN} offline in {took:.2f} s, {degraded} degraded")
            assert degraded == 7
            assert took < 5.0, "offline positions must be skipped, not retried"
            ledger.verify(client)
        # Committed degraded: each chunk's record names the position not stored.
        before = {p: asyncio.run(_fragments(meta, p, down_addr)) for p in new}
        recorded = asyncio.run(_missing(meta, list(new)))
        for p, (chunks, pos, _) in before.items():
            assert recorded[p] == [(j,) for j in pos], (p, recorded[p], pos)
            for got, j in zip(chunks, pos, strict=True):
                assert j not in got and len(got) == 5, "the degraded write stored K+1 fragments"

        t0 = time.monotonic()
        fc.restart_all()
        with fc.client(request_timeout=1.0) as client:
            # The returned node holds generation 1 of /dw/f and nothing newer:
            # never read as the new one.
            ledger.verify(client)
        # No scrub is asked for: the restarted node's repair-queue worker
        # rebuilds the recorded positions and meta's records become whole.
        end = time.monotonic() + 30
        while any(m for ms in asyncio.run(_missing(meta, list(new))).values() for m in ms):
            assert time.monotonic() < end, f"records still degraded: {asyncio.run(_missing(meta, list(new)))}"
            time.sleep(0.2)
        print(f"repair queue caught up {time.monotonic() - t0:.2f} s after the restart began")
        assert asyncio.run(_queue_rebuilt(meta)) == 7

        rep = asyncio.run(scrub_cluster(meta, timeout=60))
        print(f"scrub: {rep['total']}")
        assert rep["total"]["missing"] == 0 and rep["total"]["mismatched"] == 0, rep["total"]
        assert rep["total"]["errors"] == 0 and rep["total"]["unreachable"] == 0, rep
        assert rep["total"]["chunks_verified"] == 7, rep["total"]  # each committed chunk by one node

        for p, content in new.items():
            chunks, pos, k = asyncio.run(_fragments(meta, p, down_addr))
            for idx, (got, j) in enumerate(zip(chunks, pos, strict=True)):
                assert len(got) == 6, f"{p} chunk {idx}: {sorted(got)} present after the repair"
                chunk = content[idx * MiB:(idx + 1) * MiB]
                f = MiB // k
                if j < k:  # a data fragment: its bytes are the chunk's
                    assert got[j] == chunk[j * f:(j + 1) * f], f"{p} chunk {idx}: rebuilt data fragment differs"
                codec = Codec("ec", k, 2)
                for lost in itertools.combinations([x for x in range(6) if x != j], 2):
                    frags = {x: memoryview(got[x]) for x in range(6) if x not in lost}
                    out = codec.decode(frags, max(len(v) for v in frags.values()))
                    assert digest(out[:MiB]) == digest(chunk), f"{p} chunk {idx} without {lost}"

        others = [n for n in fc.storage_names() if n != DOWN][:2]
        for n in others:
            fc.cl.kill(n)
        with fc.client(request_timeout=1.0) as client:
            ledger.verify(client)
    finally:
        fc.close()
