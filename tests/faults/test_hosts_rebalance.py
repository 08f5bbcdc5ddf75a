"""Rebalancing through the multi-host fixture (tests/hosts.py): a storage
host joins a running 6-host cluster, placement gives it its share, and every
acknowledged byte stays readable throughout (a checker reads every file
again and again while the fragments move), with a client on its own host
writing and reading all along.

It needs the rebalancer (leader-side planning, the migrator, `tierfs
rebalance status`: branch sc-rebalance). Until that is merged the test is
skipped, which the skip policy reports as a failure ([other]): not done.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.harness import FAST_META, Ledger, MiB, fragment_files, random_bytes
from tests.faults.test_hosts import _acked_since, _finish_loop, _verify_manifest
from tests.hosts import REPO, HostCluster, wait_until
from tierfs.meta.config import MetaConfig
from tierfs.proto.v1 import meta_pb2 as pb


def _rebalance_supported() -> bool:
    svc = pb.DESCRIPTOR.services_by_name.get("MetaService")
    return "rebalance" in pb.GetStatusReply.DESCRIPTOR.fields_by_name or (
        svc is not None and any("Rebalance" in m.name for m in svc.methods))


def _host_bytes(hc: HostCluster) -> dict[str, int]:
    """Fragment bytes on each storage host's disk (the truth, not meta's view)."""
    return {h.name: sum(p.stat().st_size for p in fragment_files(hc.cl, h.name)) for h in hc.storage_hosts()}


def _balanced(hc: HostCluster, tolerance: float = 0.10) -> dict[str, int] | None:
    b = _host_bytes(hc)
    mean = sum(b.values()) / len(b)
    return b if mean and all(abs(v - mean) <= tolerance * mean for v in b.values()) else None


@pytest.mark.timeout(240)
@pytest.mark.skipif(not _rebalance_supported(), reason="rebalancing needs the rebalancer (tierfs rebalance status: "
                    "branch sc-rebalance); not done until it runs")
def test_host_joins_gets_its_share_every_byte_readable_throughout(tmp_path: Path) -> None:
    fast = [*FAST_META]
    if any(f.name == "rebalance_interval" for f in dataclasses.fields(MetaConfig)):
        fast.append("--rebalance-interval=1s")
    with HostCluster(tmp_path / "hc", n_storage=6, extra_meta_args=fast) as hc:
        ledger = Ledger()
        out, stop = tmp_path / "loop.out", tmp_path / "stop"
        with hc.client(request_timeout=2.0) as client:
            client.mkdir("/rb")
            client.set_layout("/rb", chunk_size=MiB, redundancy="ec:4+2")
            for i in range(12):
                assert ledger.write(client, f"/rb/f{i}", random_bytes(2 * MiB + i, seed=300 + i)), ledger.errors
            before = _host_bytes(hc)
            loop = hc.start_client("client-0", "loop", "--dir", "/rbl", "--size", str(MiB), "--seed", "30",
                                   "--stop", str(stop), "--max-seconds", "200", out=out)
            try:
                wait_until(lambda: _acked_since(out, 0) >= 1, 30, "client host's first write")
                new = hc.add_storage_host()
                hc.wait_healthy(60)
                t0 = time.monotonic()
                checks = 0
                deadline = t0 + 150
                # The checker: every acknowledged file, exact, again and again while fragments move.
                while not (done := _balanced(hc)):
                    assert time.monotonic() < deadline, f"not balanced within +-10%: {_host_bytes(hc)}"
                    ledger.verify(client)
                    checks += 1
                took = time.monotonic() - t0
                ledger.verify(client)
                assert done[new.name] > 0
                wait_until(lambda: _acked_since(out, time.time() - 5) >= 1, 30, "client host still writing")
            finally:
                doc = _finish_loop(hc, loop, stop, out)
        _verify_manifest(hc, doc["files"])
        status = subprocess.run([sys.executable, "-m", "tierfs.cli", "rebalance", "status", "--json"], capture_output=True, text=True, timeout=60,
                                env=hc.client_env(), cwd=str(REPO))
        assert status.returncode == 0, status.stderr
        print(f"\nhost {new.name} joined: balanced within +-10% after {took:.1f}s, {checks} full checks during the "
              f"move; bytes before {before}, after {done}; rebalance status {json.loads(status.stdout)}")
