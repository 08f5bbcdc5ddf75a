"""The KV checker (tests/checker/kv_walk.py), bounded: two seeded walks on
one real cluster (1 meta, 6 storage daemons), every KV pool redundancy,
daemons killed, stopped and corrupted on disk. Longer runs: ``make soak``
(tests/soak/test_checker_soak.py, ``TIERFS_KV_CHECKER_SEEDS``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checker.kv_walk import run_walk, setup_pools
from tests.checker.walk import CheckerCluster

pytestmark = pytest.mark.timeout(900)


def test_kv_walks_never_return_wrong_bytes(tmp_path: Path) -> None:
    env = CheckerCluster(tmp_path / "cluster", n_storage=6)
    try:
        setup_pools(env)
        walks = [run_walk(env, seed, 120, tmp_path / "logs") for seed in (7, 8)]
    finally:
        env.close()
    for ck in walks:
        # Not a walk that only missed: the hits are what is checked.
        assert ck.counts.get("hit", 0) > 20, ck.counts
        assert ck.counts.get("overwrite", 0) > 5 and ck.counts.get("kill", 0) + ck.counts.get("stop", 0) > 2, \
            ck.counts
