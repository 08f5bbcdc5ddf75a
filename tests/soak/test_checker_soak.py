"""The model-based checker (tests/checker) for longer: seeded random walks
one after another on one real cluster (1 meta, 7 storage daemons, 64 KiB
chunks), alternating ``ec:4+2`` and ``replica:3``, until
``TIERFS_CHECKER_SECONDS`` have passed or the seeds in
``TIERFS_CHECKER_SEEDS`` (comma-separated) are done; each walk has
``TIERFS_CHECKER_STEPS`` operations (default 150) and ends with every file
read back and scrubs until one finds nothing, whose verdict and the truth on
disk must agree. The first walk removes a target (``tierfs target rm``) and
waits for the rebuild. ``TIERFS_CHECKER_META=3`` runs three meta replicas
and kills one (the leader, mostly) now and then during the walks; every
call must go on through the failover. ``make soak`` runs it for 600 s; ``make test`` does
not (the bounded walks in tests/checker/test_checker.py run there).

Every failing walk's seed and op log are printed at the end (and saved
under the test's tmp dir; replay one with ``python -m tests.checker.replay``).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from pathlib import Path

import pytest

from tests.checker.walk import Checker, CheckerCluster, CheckFailed, random_ops
from tierfs.errors import TierFSError

SECONDS = float(os.environ.get("TIERFS_CHECKER_SECONDS", "0"))
SEEDS = [int(s) for s in os.environ.get("TIERFS_CHECKER_SEEDS", "").split(",") if s.strip()]
STEPS = int(os.environ.get("TIERFS_CHECKER_STEPS", "150"))
FIRST_SEED = int(os.environ.get("TIERFS_CHECKER_FIRST_SEED", "100"))
#: 3: three meta replicas, and meta leaders SIGKILLed during the walks.
META = int(os.environ.get("TIERFS_CHECKER_META", "1"))
#: 1 (with META=3): the meta nemesis too, leaders killed in the middle of operations.
NEMESIS = os.environ.get("TIERFS_CHECKER_META_NEMESIS", "") == "1"
#: N: walks add storage daemons (one a walk at most) until there are N.
GROW = int(os.environ.get("TIERFS_CHECKER_GROW", "0"))
#: 1: walks also restart a storage daemon with its target full now and then
#: (a grown one first, the destination of moves in flight), and back.
SQUEEZE = os.environ.get("TIERFS_CHECKER_SQUEEZE", "") == "1"
CS = 64 << 10
LAYOUTS = (("ec", "ec:4+2"), ("rep", "replica:3"))


@pytest.mark.skipif(not SECONDS and not SEEDS,
                    reason="set TIERFS_CHECKER_SECONDS or TIERFS_CHECKER_SEEDS (make soak sets the first)")
@pytest.mark.timeout(SECONDS + 600 * max(1, len(SEEDS)) + 300)
def test_checker_soak(tmp_path: Path) -> None:
    env = CheckerCluster(tmp_path / "cluster", n_storage=7, n_meta=META)
    failures: list[str] = []
    walks: list[str] = []
    try:
        end = time.monotonic() + SECONDS
        root = ""
        seeds = iter(SEEDS) if SEEDS else iter(range(FIRST_SEED, FIRST_SEED + 1_000_000))
        for i, seed in enumerate(seeds):
            if not SEEDS and time.monotonic() >= end:
                break
            kind, red = LAYOUTS[i % 2]
            env.heal()
            client = env.client()
            if root:
                # The scrub's verdict is cluster-wide: a walk that ended with
                # a chunk beyond repair (every copy corrupted: the walk is
                # excused, or failed for another reason) must not leave it
                # to fail the next walk's convergence check.
                with contextlib.suppress(TierFSError):
                    client.rm(root, recursive=True)
            root = f"/soak-{kind}-{seed}"
            client.mkdir(root)
            client.set_layout(root, chunk_size=CS, redundancy=red)
            ck = Checker(env, client, root, seed=seed, log_dir=tmp_path / "logs")
            t0 = time.monotonic()
            kills = len(env.nemesis_log)
            moved0 = env.rebalance().moves_done if GROW else 0
            if NEMESIS:
                env.start_meta_nemesis(seed)
            try:
                grow = 1 if len(env.storage()) < GROW else 0
                ck.run(random_ops(ck, random.Random(seed), STEPS, cs=CS, target_rm=i == 0, grow=grow,
                                    squeeze=SQUEEZE))
            except CheckFailed as exc:
                events = [f"{at - t0:.1f}s {what}" for at, what in env.nemesis_log[kills:]]
                failures.append(str(exc) + (f"\nmeta nemesis (seconds into the walk): {events}" if NEMESIS else ""))
            finally:
                env.stop_meta_nemesis()
            moved = ""
            if GROW:
                try:
                    moved = f"{env.rebalance().moves_done - moved0} group moves done"
                except TierFSError as exc:
                    # Meta unanswering after the walk healed it is a failure
                    # of its own (stop 38: two replicas that never elected).
                    events = [f"{at - t0:.1f}s {what}" for at, what in env.nemesis_log[kills:]]
                    failures.append(f"seed {seed}: meta did not answer after the walk: {exc}"
                                    + (f"\nmeta nemesis (seconds into the walk): {events}" if NEMESIS else ""))
                    moved = "meta unanswering"
            walks.append(f"{kind} seed {seed}: {time.monotonic() - t0:.0f}s, {len(ck.log)} steps, "
                         f"{sum(v for k, v in ck.counts.items() if k.startswith('violation:'))} violations, "
                         f"{ck.counts.get('corrupted', 0)} fragments corrupted, {ck.counts.get('forged', 0)} forged, "
                         f"{ck.counts.get('read_failed', 0)} reads failed, "
                         f"{ck.counts.get('whole_chunk_rereads', 0)} partial reads read whole (no STAT)"
                         + (f", {ck.counts.get('meta_kill', 0)} meta kills" if META > 1 else "")
                         + (f", {sum(1 for _, w in env.nemesis_log[kills:] if w.startswith('kill'))} by the nemesis"
                            if NEMESIS else "")
                         + (f", {len(ck.grown)} storage daemons added, {moved}" if GROW else "")
                         + (f", {ck.counts.get('squeezed', 0)} targets squeezed full "
                            f"({ck.counts.get('squeezed_moving', 0)} of a move in flight)" if SQUEEZE else ""))
            print(walks[-1], flush=True)
            if moved == "meta unanswering":
                break
    finally:
        env.close()
    print("\nchecker soak:\n  " + "\n  ".join(walks))
    assert walks, "no walk ran"
    assert not failures, f"{len(failures)} of {len(walks)} walks failed:\n\n" + "\n\n".join(failures)
