"""The metadata checker (tests/checker/meta_walk.py) for longer: seeded
walks one after another on three real meta replicas, until
``TIERFS_META_CHECKER_SECONDS`` have passed or the seeds in
``TIERFS_META_CHECKER_SEEDS`` (comma-separated) are done, each of
``TIERFS_META_CHECKER_STEPS`` operations (default 300). ``make soak`` runs
it for 300 s; ``make test`` runs the bounded walks of
tests/checker/test_meta_checker.py. A failing walk's op log is saved under
the test's tmp dir (replay: ``python -m tests.checker.meta_walk FILE``).
``TIERFS_META_CHECKER_PARTITIONS=1`` adds partitions (below)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.checker.meta_walk import meta_walk_cluster, run_meta_walk
from tests.checker.walk import CheckFailed

SECONDS = float(os.environ.get("TIERFS_META_CHECKER_SECONDS", "0"))
SEEDS = [int(s) for s in os.environ.get("TIERFS_META_CHECKER_SEEDS", "").split(",") if s.strip()]
STEPS = int(os.environ.get("TIERFS_META_CHECKER_STEPS", "300"))
#: ``TIERFS_META_CHECKER_PARTITIONS=1``: replicas on hosts of their own, and
#: walks that cut links between them and between them and the client.
PARTITIONS = os.environ.get("TIERFS_META_CHECKER_PARTITIONS", "") not in ("", "0")


@pytest.mark.skipif(not SECONDS and not SEEDS,
                    reason="set TIERFS_META_CHECKER_SECONDS or TIERFS_META_CHECKER_SEEDS (make soak sets the first)")
@pytest.mark.timeout(SECONDS + 600 * max(1, len(SEEDS)) + 300)
def test_meta_checker_soak(tmp_path: Path) -> None:
    failures: list[str] = []
    walks: list[str] = []
    with meta_walk_cluster(tmp_path / "meta", partitions=PARTITIONS) as cluster:
        end = time.monotonic() + SECONDS
        seeds = iter(SEEDS) if SEEDS else iter(range(1000, 1_000_000))
        for seed in seeds:
            if not SEEDS and time.monotonic() >= end:
                break
            try:
                ck = run_meta_walk(cluster, seed, STEPS, tmp_path / "logs")
                c = ck.counts
                walks.append(f"seed {seed}: {c.get('seconds')}s, {len(ck.log)} steps, {c.get('acked', 0)} acked, "
                             f"{c.get('refused', 0)} refused, {c.get('pending-applied', 0)}+"
                             f"{c.get('pending-not-applied', 0)} pending applied+not"
                             + (f", {c.get('cuts', 0)} links cut" if PARTITIONS else ""))
            except CheckFailed as exc:
                failures.append(str(exc))
                walks.append(f"seed {seed}: FAILED")
            print(walks[-1], flush=True)
    print("\nmeta checker soak:\n  " + "\n  ".join(walks))
    assert walks, "no walk ran"
    assert not failures, f"{len(failures)} of {len(walks)} walks failed:\n\n" + "\n\n".join(failures)
