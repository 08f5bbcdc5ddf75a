"""The model-based checker of the file data path (tests/checker/walk.py), on
a real cluster: 1 meta replica and 7 storage daemons, 64 KiB chunks so that
small operations span chunk boundaries, ``ec:4+2`` and ``replica:3``.

* The two reproductions of issue 8 as fixed operation sequences.
* Seeded random walks (fixed seeds here; ``make soak`` runs more, see
  tests/soak/test_checker_soak.py): opens in every mode, writes at random
  offsets and sizes, reads through every kind of handle, truncate, rename,
  unlink, readers held open while the file is rewritten, SIGKILL/SIGSTOP of
  storage nodes, a fragment corrupted on disk, ``tierfs target rm`` and
  rebuild, and scrubs whose verdicts are checked against the truth on disk.
* One walk on a cluster of three meta replicas, the leader SIGKILLed (or
  all three at once) now and then.

A failure prints the seed and the op log (and saves it; replay with
``python -m tests.checker.replay FILE``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.checker.walk import Checker, CheckerCluster, Op, random_ops

KiB = 1024
CS = 64 * KiB
LAYOUTS = {"ec": "ec:4+2", "rep": "replica:3"}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CheckerCluster]:
    e = CheckerCluster(tmp_path_factory.mktemp("checker"), n_storage=7)
    try:
        yield e
    finally:
        e.close()


_dirs = iter(range(1, 1000))


def checker(env: CheckerCluster, kind: str, tmp_path: Path, seed: int | None = None) -> Checker:
    env.heal()
    client = env.client()
    root = f"/{kind}{next(_dirs)}"
    client.mkdir(root)
    client.set_layout(root, chunk_size=CS, redundancy=LAYOUTS[kind])
    return Checker(env, client, root, seed=seed, log_dir=tmp_path)


def degraded_reupload() -> list[Op]:
    """Issue 8, reproduction 1: a chunk re-uploaded while the node holding
    its fragment 0 is down; the node comes back with the older upload."""
    return [
        ("open", "h1", "y", "w"),
        ("write", "h1", None, ("fill", ord("A"), 1000)),
        ("flush", "h1"),
        ("kill_holder", "y", 0, 0),
        ("write", "h1", None, ("fill", ord("B"), 1000)),
        ("close", "h1"),
        ("settle",),  # restart the node
        ("fresh_client",),  # a reader that does not know the node was away
        ("scrub", False),  # report only: must not call this clean while a fragment is missing or stale
        ("read_file", "y"),
        ("read_range", "y", 990, 20),
        ("open", "h2", "y", "r"),
        ("read", "h2", -1),
        ("close", "h2"),
    ]


def truncate_zeroes_tail() -> list[Op]:
    """Issue 8, reproduction 2, then a repair of that chunk: a rebuilt
    fragment must match its parity and the chunk record."""
    return [
        ("write_file", "s", ("rep", "SECRET", 500)),
        ("truncate", "s", 6),
        ("truncate", "s", 3000),
        ("read_file", "s"),  # 6 bytes, then 2,994 zeros
        ("read_range", "s", 0, 100),
        ("open", "h1", "s", "r+"),
        ("read", "h1", -1),
        ("seek", "h1", 2000),
        ("write", "h1", None, ("fill", ord("x"), 10)),
        ("seek", "h1", 0),
        ("read", "h1", -1),
        ("close", "h1"),
        ("read_file", "s"),
        ("truncate", "s", 3),
        ("truncate", "s", 70000),  # now spans two chunks
        ("delete_frag", "s", 0, 0),  # the scrub rebuilds it: at its stored length, not trimmed to the file
        ("corrupt", "s", 0, 4),
        ("scrub", True),
        ("read_file", "s"),
    ]


def forged_fragments() -> list[Op]:
    """Fragments rewritten whole with other bytes (their own CRC32C valid),
    one of them next to a lost fragment: reads must decode around the
    forged ones, and a repairing scrub must rebuild them and the lost one."""
    return [
        ("write_file", "g", ("rand", 7, 200_000)),  # four chunks
        ("forge", "g", 0, 1),
        ("read_file", "g"),
        ("read_range", "g", 100, 50),
        ("forge", "g", 1, 0),
        ("delete_frag", "g", 1, 3),
        ("read_file", "g"),
        ("read_range", "g", CS + 10, 3000),
        ("scrub", True),
        ("read_file", "g"),
    ]


def forged_after_a_verified_read() -> list[Op]:
    """The file checker soak, seed 15017, shrunk: a partial read verifies
    chunk 0 (the file was truncated into it), a fragment of it is then
    forged, and an ``r+`` handle rewrites the chunk's first bytes: the rest
    of the chunk, read back for the write, must be the chunk's own bytes,
    not the forged ones (they were, and the close committed them)."""
    return [
        ("write_file", "v", ("rand", 671034029, 65537)),
        ("truncate", "v", 32768),
        ("read_file", "v"),  # a partial read of chunk 0: verified
        ("forge", "v", 0, 0),
        ("open", "h1", "v", "r+"),
        ("write", "h1", 0, ("rand", 1066880568, 1000)),
        ("read", "h1", 65541),
        ("close", "h1"),
        ("fresh_client",),
        ("read_file", "v"),
    ]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", ["ec", "rep"])
def test_regression_degraded_reupload(env: CheckerCluster, kind: str, tmp_path: Path) -> None:
    ck = checker(env, kind, tmp_path)
    ck.run(degraded_reupload())
    assert ck.model.files["y"].cands == [b"A" * 1000 + b"B" * 1000]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["ec", "rep"])
def test_regression_truncate_zeroes_tail(env: CheckerCluster, kind: str, tmp_path: Path) -> None:
    ck = checker(env, kind, tmp_path)
    ck.run(truncate_zeroes_tail())
    assert ck.model.files["s"].cands == [b"SEC" + bytes(70000 - 3)]


#: The forgery regressions: the fixed walk and how many fragments it forges.
FORGED = {"forged_fragments": (forged_fragments, 2), "forged_after_a_verified_read": (forged_after_a_verified_read, 1)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["ec", "rep"])
@pytest.mark.parametrize("case", sorted(FORGED))
def test_regression_forged(env: CheckerCluster, kind: str, case: str, tmp_path: Path) -> None:
    ops, forged = FORGED[case]
    ck = checker(env, kind, tmp_path)
    ck.run(ops())
    assert ck.counts.get("forged") == forged, ck.counts


#: (layout, seed, steps). Bounded for `make test`; tests/soak runs longer walks.
WALKS = [("ec", 1, 50), ("rep", 3, 40)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("kind", "seed", "steps"), WALKS, ids=[f"{k}-seed{s}" for k, s, _ in WALKS])
def test_random_walk(env: CheckerCluster, kind: str, seed: int, steps: int, tmp_path: Path) -> None:
    ck = checker(env, kind, tmp_path, seed)
    ck.run(random_ops(ck, random.Random(seed), steps, cs=CS, target_rm=False))
    print(f"\nchecker {kind} seed {seed}: {dict(sorted(ck.counts.items()))}; seconds: "
          f"{ {k: round(v, 1) for k, v in sorted(ck.seconds.items())} }")


@pytest.mark.timeout(400)
def test_random_walk_with_target_rm(env: CheckerCluster, tmp_path: Path) -> None:
    """Last in the module: the cluster has 7 nodes, so one target can be
    removed (its groups rebuild onto the seventh); the walk removes it."""
    seed = 4
    ck = checker(env, "ec", tmp_path, seed)
    rng = random.Random(seed)
    ops = [*list(_prefix(ck, rng)), ("target_rm", "storage-2")]
    ck.run(ops, finish=False)
    ck.run(random_ops(ck, rng, 20, cs=CS, target_rm=False))
    assert env.removed, "the walk removed no target"


def _prefix(ck: Checker, rng: random.Random) -> Iterator[Op]:
    for i in range(4):
        yield ("write_file", f"f{i}", ("rand", rng.randrange(1 << 30), rng.choice([1000, CS + 1, 3 * CS - 7])))


@pytest.mark.timeout(400)
def test_random_walk_through_meta_failovers(tmp_path: Path) -> None:
    """Three meta replicas: the walk SIGKILLs the leader (or all three at
    once) now and then; every call goes on through the failover, and what
    meta acknowledged stays (``make soak`` with TIERFS_CHECKER_META=3 runs
    more)."""
    env = CheckerCluster(tmp_path / "cluster", n_storage=6, n_meta=3)
    try:
        seed = 9961
        ck = checker(env, "ec", tmp_path, seed)
        ck.run(random_ops(ck, random.Random(seed), 120, cs=CS, target_rm=False))
        assert ck.counts.get("meta_kill", 0) + ck.counts.get("meta_crash_all", 0) >= 2, ck.counts
    finally:
        env.close()
