"""Rebalancing through the multi-host fixture (tests/hosts.py): a cluster of
4 storage hosts with data grows to 6 hosts (each new daemon on a new host
of its own), and the rebalancer moves group members onto them by copy
while a checker writes new files and re-reads every acknowledged one, and a
client on its own host reads its files again and again. The body is
tests/scale/test_rebalance.py's :func:`grow_and_rebalance` (every target
within 10% of the mean by bytes on disk afterwards, moved bytes close to
the minimum, scrub deletes the old copies), run here on namespaced hosts.

The client host only reads during the move: its writes would still be in
flight when the body's scrubs run (orphan grace 0 there: a fragment of an
uncommitted write counts as an orphan) and would unbalance the targets
again. Writes through the move are the checker's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.hosts import HostCluster, wait_until
from tests.repair.util import STORAGE_FAST
from tests.scale.test_rebalance import REBALANCE, disk_bytes, grow_and_rebalance


@pytest.mark.timeout(240)
def test_hosts_grow_4_to_6_rebalance_with_no_unreadable_byte(tmp_path: Path) -> None:
    meta_args = ("--heartbeat-timeout=3", "--tick-interval=0.2", *REBALANCE)
    # 2 MiB/s of copy per node (as tests/scale/): the moves take seconds, the checker runs through them.
    with HostCluster(tmp_path / "hc", n_storage=4, extra_meta_args=meta_args,
                     extra_storage_args=[*STORAGE_FAST, "--rebuild-rate=2MiB"], gc_grace=0.5) as hc:
        manifest = hc.run_client("client-0", "write", "--dir", "/rbc", "--files", "6", "--size", str(256 << 10),
                                 "--redundancy", "ec:2+1", "--chunk-size", str(128 << 10))
        (tmp_path / "m.json").write_text(json.dumps(manifest))
        out, stop = tmp_path / "reread.out", tmp_path / "stop"
        reader = hc.start_client("client-0", "reread", "--manifest", str(tmp_path / "m.json"), "--stop", str(stop),
                                 "--max-seconds", "200", out=out)
        try:
            wait_until(lambda: '"round": 1,' in out.read_text(), 30, "client host's first pass")

            def grow(n: int) -> None:
                while len(hc.storage_hosts()) < n:
                    hc.add_storage_host()
                hc.wait_healthy(60)

            r = asyncio.run(grow_and_rebalance(hc, grow, lambda cmap: disk_bytes(hc.cl, cmap)))
        finally:
            stop.touch()
            rc = reader.wait(60)
        assert rc == 0, out.with_suffix(".log").read_text()[-3000:]
        doc = json.loads(out.read_text().strip().splitlines()[-1])
        assert doc["rounds"] >= 2 and not doc["errors"] and not doc["bad"], doc
        print(f"\nhosts 4 -> 6: rebalanced in {r['seconds']:.1f}s, moved {r['moved_over_minimum']:.2f}x the minimum, "
              f"checker {r['checker_reads']} reads / {r['checker_writes']} writes; the client host read its 6 files "
              f"{doc['rounds']} times over, every byte exact")
        assert r["moved_over_minimum"] <= 1.3, r
