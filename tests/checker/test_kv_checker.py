"""The KV checker (tests/checker/kv_walk.py), bounded: two seeded walks on
one real cluster (1 meta, 6 storage daemons), every KV pool redundancy,
daemons killed, stopped and corrupted on disk. Longer runs: ``make soak``
(tests/soak/test_checker_soak.py, ``TIERFS_KV_CHECKER_SEEDS``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


@pytest.mark.timeout(30)
def test_the_model_refuses_a_content_an_acknowledged_overwrite_or_delete_superseded() -> None:
    """The judge alone (no cluster): after an acknowledged delete or
    overwrite, a get that started after it may return only what was put
    since, or what an unacknowledged put may still bring back; a racing get
    that started before it may return the old content."""
    from tests.checker.kv_walk import KVChecker, content

    ck = KVChecker(env=None, client=None, seed=1)  # type: ignore[arg-type]
    pk = ("kr1", 3)
    ck.log.append(("put", *pk))
    ck._attempt(pk, 0)
    ck._judge(*pk, content(*pk, 0), "get")
    before = ck.settled.get(pk)
    ck._settle(pk, "delete", set())
    ck._judge(*pk, content(*pk, 0), "racing get", None, before)  # started before the delete
    assert ck.violations == []
    ck._judge(*pk, content(*pk, 0), "get")
    assert len(ck.violations) == 1 and "[superseded]" in ck.violations[0] and "delete" in ck.violations[0]

    ck.violations.clear()
    ck._attempt(pk, 1)  # an overwrite to content 1, acknowledged
    ck._settle(pk, "overwrite", {1})
    ck._judge(*pk, content(*pk, 1), "get")
    assert ck.violations == []
    ck._judge(*pk, content(*pk, 0), "get")
    assert len(ck.violations) == 1 and "overwrite" in ck.violations[0]

    ck.violations.clear()
    ck._attempt(pk, 2)  # an overwrite that raised: it may land at any time
    ck._maybe(pk, 2)
    ck._settle(pk, "delete", set())
    ck._judge(*pk, content(*pk, 2), "get")
    assert ck.violations == [] and ck.counts["stale"] == 4


@pytest.mark.timeout(30)
def test_the_model_lets_a_forged_copy_through_only_from_an_unwitnessed_hit() -> None:
    """The judge alone: the bytes of a forged replica copy are a violation
    (``forged-served``) unless the get that returned them was a hit no
    other copy could vouch for (its client's ``unwitnessed`` count grew
    during it, and the client does not require a witness) or a hit of the
    client's own local tiers; then they are counted."""
    from tests.checker.kv_walk import KVChecker

    class Counts:  # what the judge reads of a client: its pool's counters
        unwitnessed = 0
        local_hits = 0

        def kv_pool(self, pool: str) -> Counts:
            return self

        def stats(self) -> dict[str, Any]:
            return {"cluster": {"unwitnessed": self.unwitnessed}, "tiers": [{"hits": self.local_hits}]}

    client = Counts()
    ck = KVChecker(env=None, client=client, seed=1)  # type: ignore[arg-type]
    pk, forged = ("kr2", 3), bytes(range(200))
    ck.log.append(("forge", *pk, 0))
    ck.forged[pk] = {forged}
    client.unwitnessed = 5  # unwitnessed hits before this get do not excuse it
    before = ck._snap(client, "kr2")  # type: ignore[arg-type]
    ck._judge(*pk, forged, "get", before=before)
    assert len(ck.violations) == 1 and "[forged-served]" in ck.violations[0]
    ck.violations.clear()
    client.unwitnessed += 1  # this get was one
    ck._judge(*pk, forged, "get", before=before)
    before = ck._snap(client, "kr2")  # type: ignore[arg-type]
    client.local_hits += 1  # a hit of the client's own tiers
    ck._judge(*pk, forged, "get", before=before)
    assert ck.violations == [] and ck.counts["forged_unwitnessed"] == 2
    ck._judge(*pk, bytes(200), "get", before=before)  # bytes no one wrote, forged or not
    assert len(ck.violations) == 1 and "[wrong-bytes]" in ck.violations[0]
    ck.violations.clear()
    # A client that requires a witness turns an unwitnessed copy into a
    # miss: forged bytes from it are a violation, unless its local tiers
    # served them.
    ck.strict_clients.add(id(client))
    before = ck._snap(client, "kr2")  # type: ignore[arg-type]
    client.unwitnessed += 1
    ck._judge(*pk, forged, "get", before=before)
    assert len(ck.violations) == 1 and "requires a witness" in ck.violations[0]
    before = ck._snap(client, "kr2")  # type: ignore[arg-type]
    client.local_hits += 1
    ck._judge(*pk, forged, "get", before=before)
    assert len(ck.violations) == 1 and ck.counts["forged_unwitnessed"] == 3
