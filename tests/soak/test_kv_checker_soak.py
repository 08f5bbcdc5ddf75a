"""The KV checker (tests/checker/kv_walk.py) for longer: seeded walks one
after another on one real cluster (1 meta, 6 storage daemons), until
``TIERFS_KV_CHECKER_SECONDS`` have passed or the seeds in
``TIERFS_KV_CHECKER_SEEDS`` (comma-separated) are done, each of
``TIERFS_KV_CHECKER_STEPS`` operations (default 200).
``TIERFS_KV_CHECKER_META=3`` runs three meta replicas and kills them now
and then (tests/checker/walk.py, ``meta_fault``); with
``TIERFS_KV_CHECKER_META_NEMESIS=1`` a thread also kills them at random
moments, in the middle of operations. ``make soak`` runs it
for 300 s; ``make test`` runs the bounded walks of
tests/checker/test_kv_checker.py. A failing walk's op log is saved under the
test's tmp dir."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.checker.kv_walk import POOLS, run_walk, setup_pools
from tests.checker.walk import CheckerCluster, CheckFailed

SECONDS = float(os.environ.get("TIERFS_KV_CHECKER_SECONDS", "0"))
SEEDS = [int(s) for s in os.environ.get("TIERFS_KV_CHECKER_SEEDS", "").split(",") if s.strip()]
# A seed names its walk's keys: the same seed twice on one cluster would meet its own old values.
assert len(set(SEEDS)) == len(SEEDS), "TIERFS_KV_CHECKER_SEEDS lists a seed twice"
STEPS = int(os.environ.get("TIERFS_KV_CHECKER_STEPS", "200"))
#: 3: three meta replicas, one SIGKILLed now and then (the leader, mostly), or all of them at once.
META = int(os.environ.get("TIERFS_KV_CHECKER_META", "1"))
#: 1 (with META=3): the meta nemesis too, replicas (mostly the leader) killed from a thread mid-operation.
NEMESIS = os.environ.get("TIERFS_KV_CHECKER_META_NEMESIS", "") == "1"


@pytest.mark.skipif(not SECONDS and not SEEDS,
                    reason="set TIERFS_KV_CHECKER_SECONDS or TIERFS_KV_CHECKER_SEEDS (make soak sets the first)")
@pytest.mark.timeout(SECONDS + 600 * max(1, len(SEEDS)) + 300)
def test_kv_checker_soak(tmp_path: Path) -> None:
    env = CheckerCluster(tmp_path / "cluster", n_storage=6, n_meta=META)
    failures: list[str] = []
    walks: list[str] = []
    try:
        setup_pools(env)
        end = time.monotonic() + SECONDS
        seeds = iter(SEEDS) if SEEDS else iter(range(1000, 1_000_000))
        for seed in seeds:
            if not SEEDS and time.monotonic() >= end:
                break
            kills, t0 = len(env.nemesis_log), time.monotonic()
            try:
                ck = run_walk(env, seed, STEPS, tmp_path / "logs", meta_nemesis=NEMESIS)
                walks.append(f"seed {seed}: {ck.counts.get('seconds')}s, {len(ck.log)} steps, "
                             f"{ck.counts.get('hit', 0)} hits ({ck.counts.get('stale', 0)} stale), "
                             f"{ck.counts.get('miss', 0)} misses, {ck.counts.get('forged', 0)} fragments or copies forged "
                             f"({ck.counts.get('disagreements', 0)} copies disagreed, "
                             f"{ck.counts.get('unwitnessed', 0)} hits unwitnessed, "
                             f"{ck.counts.get('forged_unwitnessed', 0)} forged bytes served unwitnessed"
                             + (f"; racing reader requires a witness: {ck.counts.get('strict_misses', 0)} misses "
                                f"for want of one (" + ", ".join(f"{p} {ck.counts.get('strict_misses:' + p, 0)}"
                                                                for p in POOLS) + ")" if seed % 2 == 0 else "")
                             + "), "
                             f"{ck.counts.get('ttl-judged', 0)} hits of TTL "
                             f"contents judged, {ck.counts.get('late_clients', 0)} late clients, "
                             f"{ck.counts.get('delete', 0)} deletes ({ck.counts.get('delete-failed', 0)} not "
                             f"acknowledged), {ck.counts.get('map_retries', 0)} puts re-placed ("
                             + ", ".join(f"{p} {ck.counts.get('map_retries:' + p, 0)}" for p in POOLS) + ")"
                             + (f", {ck.counts.get('meta_kill', 0)} meta kills" if META > 1 else "")
                             + (f", {sum(1 for _, w in env.nemesis_log[kills:] if w.startswith('kill'))} by the "
                                f"nemesis" if NEMESIS else ""))
                print(walks[-1], flush=True)
                for note in ck.stale_notes[:5]:
                    print(f"    stale: {note}", flush=True)
                if ck.stale_notes:  # the op log, to trace them (a nemesis walk does not replay step for step)
                    (tmp_path / "logs").mkdir(parents=True, exist_ok=True)
                    f = tmp_path / "logs" / f"kv-walk-{seed}-stale.json"
                    f.write_text(json.dumps({"seed": seed, "ops": ck.log, "stale": ck.stale_notes,
                                             "nemesis": [(round(at - t0, 2), what)
                                                         for at, what in env.nemesis_log[kills:]]}))
                    print(f"    op log of the walk with its stale reads: {f}", flush=True)
            except CheckFailed as exc:
                events = [f"{at - t0:.1f}s {what}" for at, what in env.nemesis_log[kills:]]
                failures.append(str(exc) + (f"\nmeta nemesis (seconds into the walk): {events}" if NEMESIS else ""))
                walks.append(f"seed {seed}: FAILED")
    finally:
        env.close()
    print("\nKV checker soak:\n  " + "\n  ".join(walks))
    assert walks, "no walk ran"
    assert not failures, f"{len(failures)} of {len(walks)} walks failed:\n\n" + "\n\n".join(failures)
