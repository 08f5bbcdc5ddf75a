"""Placement stamps against a model (docs/kv.md, "Overwrites and map changes").

A KV pool's groups change as targets come and go (``replan_groups``, then
``set_groups`` records since when each member holds its position and the
group count's changes). For a key and a position of its group, the stamp a
client computes from the map (``tierfs.kv.cluster.placement``) must be the
first map version of the unbroken run, ending now, in which that key lived
in that group *and* that target held that position. A copy put before it
may have missed an overwrite made while the key or the target was
elsewhere; a copy put within it saw every write that the map routed there.

The model keeps every map version's groups and reads the runs off them; the
code under test keeps only the per-member ``since`` and the last
``HISTORY_KEPT`` count changes. No daemons: this is the placement logic
alone, run over random joins and departures.
"""

from __future__ import annotations

import random

import pytest
import xxhash

from tierfs.client.routing import KVPoolRoute
from tierfs.kv.cluster import jump_hash, mapped_since, placement
from tierfs.meta.kvpools import HISTORY_KEPT, KVPoolRecord, replan_groups, set_groups


def _pool(width: int) -> KVPoolRecord:
    return KVPoolRecord(id=1, name="p", redundancy=f"replica:{width}", width=width, target_memory=1 << 20,
                        target_disk=0, fsync=False, pin_quota=0, policy="lru", created=0)


def _truth(layouts: list[list[list[int]]], key: bytes, j: int) -> int:
    """The first version of the run ending at the last layout in which
    ``key`` was in the same group index with the same member at ``j``
    (versions are list positions + 1). A layout with no groups ends the run
    too: the groups planned after it are new, members and all."""
    h = xxhash.xxh3_64_intdigest(key)
    last = layouts[-1]
    b = jump_hash(h, len(last))
    t = last[b][j]
    start = len(layouts)
    for v in range(len(layouts) - 1, -1, -1):
        groups = layouts[v]
        if not groups or len(groups) <= b or jump_hash(h, len(groups)) != b or groups[b][j] != t:
            return start
        start = v + 1
    return 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_stamps_match_the_model_over_random_membership_changes(seed: int) -> None:
    rng = random.Random(seed)
    width = 2
    nodes = {t: t for t in range(1, 9)}  # target -> node: one target per node
    up = set(list(nodes)[:5])
    pool = _pool(width)
    layouts: list[list[list[int]]] = [[]]  # version 1: the pool, no groups yet
    set_groups(pool, [], 1)
    keys = [f"k{i}".encode() for i in range(300)]
    for step in range(80):
        # a node leaves or (re)joins
        if len(up) > width and (rng.random() < 0.5 or len(up) == len(nodes)):
            up.discard(rng.choice(sorted(up)))
        else:
            up.add(rng.choice(sorted(set(nodes) - up)))
        version = len(layouts) + 1
        groups = replan_groups([list(g) for g in pool.groups], {t: nodes[t] for t in up}, width)
        if groups != pool.groups:
            set_groups(pool, groups, version)
        layouts.append([list(g) for g in pool.groups])
        if not pool.groups:
            continue
        route = KVPoolRoute.of(pool.to_pb())
        for key in keys:
            members, stamps = placement(route, key)
            assert list(members) == pool.groups[jump_hash(xxhash.xxh3_64_intdigest(key), len(pool.groups))]
            for j in range(width):
                want = _truth(layouts, key, j)
                if len(pool.history) < HISTORY_KEPT:
                    assert stamps[j] == want, (step, key, j, stamps[j], want)
                else:  # a history cut short only errs late (a miss), never early
                    assert stamps[j] >= want, (step, key, j, stamps[j], want)


def test_a_key_that_leaves_its_group_and_comes_back_gets_a_new_stamp() -> None:
    """The case per-member ``since`` alone misses: a node joins (one group
    more), some keys move to the new group and are overwritten there, the
    node leaves again and they come back to groups whose members never
    changed, holding the value from before."""
    nodes = {t: t for t in range(1, 6)}
    pool = _pool(1)
    set_groups(pool, [], 1)
    set_groups(pool, replan_groups([], {t: t for t in range(1, 5)}, 1), 2)
    before = KVPoolRoute.of(pool.to_pb())
    set_groups(pool, replan_groups([list(g) for g in pool.groups], nodes, 1), 3)
    assert len(pool.groups) == 5
    set_groups(pool, replan_groups([list(g) for g in pool.groups], {t: t for t in range(1, 5)}, 1), 4)
    after = KVPoolRoute.of(pool.to_pb())
    assert after.groups == before.groups
    moved = stayed = 0
    for i in range(2000):
        key = f"key-{i}".encode()
        h = xxhash.xxh3_64_intdigest(key)
        went = jump_hash(h, 5) == 4
        old, new = placement(before, key)[1][0], placement(after, key)[1][0]
        if went:
            moved += 1
            assert new == 4 and new > old, "a key back from the dropped group keeps its old stamp"
        else:
            stayed += 1
            assert new == old == 2, "a key that never moved lost its copies"
    assert moved and stayed


def test_mapped_since_reads_the_count_history() -> None:
    # bucket 2 with next jump 6: the key is in bucket 2 at counts 3..6
    assert mapped_since([], 2, 6) == 0
    assert mapped_since([(5, 0), (7, 4)], 2, 6) == 0  # since the pool's first groups
    assert mapped_since([(5, 0), (7, 4), (9, 6)], 2, 6) == 0
    assert mapped_since([(5, 0), (7, 4), (9, 7), (11, 4)], 2, 6) == 11  # away at 7 groups
    assert mapped_since([(5, 0), (7, 4), (9, 0), (11, 4)], 2, 6) == 0  # no groups at all: nothing moved
    assert mapped_since([(0, 4), (8, 5)], 2, 6) == 0  # a pool from before the history
    assert mapped_since([(3, 5), (8, 4)], 2, 6) == 3  # cut short: the oldest kept bounds it


def test_replica1_ignores_a_target_coming_back_other_pools_do_not() -> None:
    """A put to a ``replica:1`` pool never skips its one target (it fails
    instead), so a target that was down holds nothing stale: its copies stay
    valid. Pools whose puts skip a down target (replica:N, EC) stamp with
    the target's ``up_since``."""
    for width, copies in ((1, "replica:1"), (2, "replica:2")):
        pool = _pool(width)
        pool.redundancy = copies
        set_groups(pool, [], 1)
        set_groups(pool, replan_groups([], {t: t for t in range(1, 4)}, width), 2)
        p = pool.to_pb()
        route = KVPoolRoute.of(p, {t: 9 for t in range(1, 4)})
        _, stamps = placement(route, b"k")
        assert set(stamps) == ({2} if width == 1 else {9})
