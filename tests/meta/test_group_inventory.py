"""The per-group chunk inventory (MetaStateMachine.ginv/gbytes) against the
full namespace scan it replaced, over random op sequences: commits,
overwrites, truncates, unlinks, renames, expired sessions, ops rolled back
half-way (the undo log) and snapshot restores. The digest must not depend on
it (derived state)."""

from __future__ import annotations

import random

import pytest

from tests.meta.meta_helpers import Driver, recs
from tierfs.chunk import parity_size
from tierfs.meta import MetaStateMachine
from tierfs.proto.v1 import meta_pb2 as pb

MARKER = "FAIL-INVENTORY"
FILE = pb.INODE_TYPE_FILE
CS = 4 << 20  # the default chunk size


def scan(sm: MetaStateMachine, gid: int) -> list[tuple[int, int, int]]:
    """The old list_group_chunks: every inode, every chunk."""
    out = []
    for ino in sorted(sm.inodes):
        f = sm.inodes[ino]
        if f.type != FILE or gid not in f.groups:
            continue
        n = len(f.groups)
        slots = {k for k, g in enumerate(f.groups) if g == gid}
        out += [(ino, c, f.chunks[c].generation) for c in sorted(f.chunks) if c % n in slots]
    return out


def scan_bytes(sm: MetaStateMachine) -> dict[int, int]:
    out: dict[int, int] = {}
    for f in sm.inodes.values():
        if f.type != FILE or not f.groups:
            continue
        assert f.layout is not None
        for c, r in f.chunks.items():
            b = r.length if f.layout.kind == pb.REDUNDANCY_KIND_REPLICA else parity_size(f.layout.k, f.layout.chunk_size, r.length)
            g = f.groups[c % len(f.groups)]
            out[g] = out.get(g, 0) + b
    return {g: b for g, b in out.items() if b}


def listed(sm: MetaStateMachine, gid: int, page: int) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    after = 0
    while True:
        r = sm.list_group_chunks(gid, after, page)
        out += [(c.inode, c.chunk, c.version) for c in r.chunks]
        if not r.next_inode:
            return out
        after = r.next_inode


def check(sm: MetaStateMachine, rng: random.Random) -> None:
    for gid in sorted(sm.groups):
        assert listed(sm, gid, rng.choice([1, 3, 10_000])) == scan(sm, gid), f"group {gid}"
    assert dict(sm.gbytes) == scan_bytes(sm)


def step(d: Driver, rng: random.Random, files: list[str]) -> None:
    x = rng.random()
    if x < 0.15 or not files:
        path = f"/f{rng.randrange(10**6)}"
        layout = rng.choice([{}, {"kind": pb.REDUNDANCY_KIND_REPLICA, "data_shards": 1, "parity_shards": 1},
                             {"stripe_width": 2}])
        d.create(path, **layout)
        files.append(path)
        return
    path = rng.choice(files)
    fail = rng.random() < 0.1
    client = MARKER if fail else ""
    try:
        if x < 0.6:
            s = d.do("open_write", pb.OpenWriteRequest(loc=pb.Loc(path=path), owner="t"), pb.OpenWriteReply)
            chunks = sorted(rng.sample(range(8), rng.randint(1, 4)))
            size = (max(chunks) + 1) * CS - rng.randrange(1 << 19)
            d.do("commit_write", pb.CommitWriteRequest(session_id=s.session_id, size=size,
                                                        chunks=recs(s.data_version, chunks,
                                                                    length=rng.choice([1 << 20, 4096]))),
                 pb.FileInfo, client=client)
        elif x < 0.75:
            d.do("truncate", pb.TruncateRequest(loc=pb.Loc(path=path), size=rng.randrange(6 * CS)), pb.FileInfo,
                 client=client)
        elif x < 0.85:
            d.do("unlink", pb.UnlinkRequest(loc=pb.Loc(path=path)), client=client)
            if not fail:
                files.remove(path)
        elif x < 0.92:
            new = f"/r{rng.randrange(10**6)}"
            d.do("rename", pb.RenameRequest(src=pb.Loc(path=path), dst=pb.Loc(path=new)), client=client)
            if not fail:
                files[files.index(path)] = new
        else:
            # A session left open and expired by a tick: its uploads go to GC.
            d.do("open_write", pb.OpenWriteRequest(loc=pb.Loc(path=path), owner="t"), pb.OpenWriteReply)
            d.advance(700)
            d.do("tick", pb.TickRequest())
    except Exception as exc:  # the injected failure (or a busy file): the state must be as before
        if not fail and "being written" not in str(exc):
            raise


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_inventory_matches_the_namespace_scan(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERFS_TEST_APPLY_FAIL_MARKER", MARKER)
    rng = random.Random(seed)
    d = Driver()
    d.register(7, 1)
    files: list[str] = []
    for i in range(150):
        step(d, rng, files)
        if i % 10 == 0:
            check(d.sm, rng)
        if i % 50 == 49:
            # A replica restored from a snapshot rebuilds the same inventory,
            # and the inventory is not part of the digest.
            snap = d.sm.snapshot()
            fresh = MetaStateMachine()
            fresh.restore(snap)
            assert fresh.digest() == d.sm.digest()
            assert dict(fresh.gbytes) == dict(d.sm.gbytes)
            assert {g: dict(v) for g, v in fresh.ginv.items()} == {g: dict(v) for g, v in d.sm.ginv.items()}
            d.sm = fresh
    check(d.sm, rng)
    assert d.sm.gbytes, "the random ops stored nothing: the test checks nothing"


def test_digest_ignores_the_inventory() -> None:
    d = Driver()
    d.register(6, 1)
    d.create("/a")
    d.write("/a", 3 * CS, [0, 1, 2])
    before = d.sm.digest()
    d.sm.ginv.clear()
    d.sm.gbytes.clear()
    assert d.sm.digest() == before
