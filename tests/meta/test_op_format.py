"""Mixed versions of meta replicas: an entry written by a newer leader
(``MetaOp.min_format`` above this code's ``OP_FORMAT``) stops an older
replica instead of being applied its own way (docs/operations.md,
"Upgrading meta replicas"). The newer version is played with
``TIERFS_TEST_OP_FORMAT`` on real replica processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.cluster import MetaCluster, wait_for
from tests.meta.meta_helpers import Driver
from tierfs.meta import MetaClient
from tierfs.meta.interfaces import LegacyEntryError, ReplicaTooOldError
from tierfs.meta.state import OP_FORMAT
from tierfs.proto.v1 import meta_pb2 as pb


def _mkdir_op(path: str, fmt: int, rid: int) -> bytes:
    op = pb.MetaOp(now_ns=1_700_000_000 * 10**9 + rid, client_id="c" * 32, request_id=rid, min_format=fmt)
    op.mkdir.CopyFrom(pb.MkdirRequest(loc=pb.Loc(path=path)))
    return op.SerializeToString(deterministic=True)


def test_an_entry_of_a_newer_format_is_refused_and_changes_nothing() -> None:
    d = Driver()
    d.mkdir("/a")
    before = d.sm.digest()
    with pytest.raises(ReplicaTooOldError, match=rf"runs meta op format {OP_FORMAT}, and the log holds an entry "
                                                 rf"of format {OP_FORMAT + 1} .*upgrade this replica"):
        d.sm.apply(_mkdir_op("/a/new", OP_FORMAT + 1, 1))
    assert d.sm.digest() == before
    # its own format and older entries (0: before the field) apply as always
    for rid, fmt in ((2, OP_FORMAT), (3, 0)):
        res = pb.MetaResult.FromString(d.sm.apply(_mkdir_op(f"/a/d{rid}", fmt, rid)))
        assert not res.error.code, res.error.message
    assert d.sm.digest() != before


def _create_op(path: str, fmt: int, rid: int) -> bytes:
    op = pb.MetaOp(now_ns=1_700_000_000 * 10**9 + rid, client_id="c" * 32, request_id=rid, min_format=fmt)
    op.create.CopyFrom(pb.CreateRequest(loc=pb.Loc(path=path), has_layout=True,
                                        layout=pb.Layout(kind=pb.REDUNDANCY_KIND_EC, data_shards=4, parity_shards=2)))
    return op.SerializeToString(deterministic=True)


def test_a_create_of_a_release_that_planned_groups_in_apply_stops_the_replica() -> None:
    """Releases before leader-planned placement groups made a width's first
    groups inside the create's apply; replayed here such a create would
    fail, and every file of the width with it (a namespace that silently
    differs from the writer's: seen upgrading from 713483f, 20 files -> 0).
    The replica stops instead, and changes nothing."""
    d = Driver()
    d.leader = False  # no AddGroups: what an old journal holds
    d.register(nodes=6, targets=1)
    assert not d.sm.groups
    before = d.sm.digest()
    with pytest.raises(LegacyEntryError, match=r"planned placement groups inside apply .*force a snapshot"):
        d.sm.apply(_create_op("/f", 0, 1))
    assert d.sm.digest() == before
    assert isinstance(LegacyEntryError("x"), ReplicaTooOldError)  # the Raft layer halts on it
    # Written by this release (format 1), the same entry is an ordinary
    # failure: its leader could not plan groups (every replica agrees).
    res = pb.MetaResult.FromString(d.sm.apply(_create_op("/f", OP_FORMAT, 2)))
    assert res.error.code and "needs 6 online targets" in res.error.message, res.error.message
    # And an old entry whose width has groups applies as it always did.
    d.top_up(6)
    res = pb.MetaResult.FromString(d.sm.apply(_create_op("/g", 0, 3)))
    assert not res.error.code, res.error.message


#: replicas 1 and 2 wait much longer before an election: replica 0 leads
SLOW_ELECTION = ["--election-timeout-min=3", "--election-timeout-max=4", "--connection-timeout=4"]


@pytest.mark.timeout(120)
def test_older_followers_stop_under_a_newer_leader_and_catch_up_once_upgraded(tmp_path: Path) -> None:
    c = MetaCluster(tmp_path / "m", n=3, state_machine="meta", start=False)
    newer = {"TIERFS_TEST_OP_FORMAT": str(OP_FORMAT + 1)}
    c.replicas[0].env = dict(newer)
    for i in (1, 2):
        c.replicas[i].extra_args = list(SLOW_ELECTION)
    try:
        for i in range(3):
            c.start(i)
        assert c.wait_leader(30) == 0
        # The newer leader's first ops (its tick, this mkdir) commit: the
        # followers journal and acknowledge them before applying.
        asyncio.run(_mkdir(c, "/made-by-newer"))
        for i in (1, 2):
            r = c.replicas[i]
            assert r.proc is not None
            code = wait_for(lambda r=r: r.proc.poll(), 30, f"replica {i} to stop")  # type: ignore[union-attr]
            assert code == 70, c.log(i)
            log = c.log(i)
            assert f"runs meta op format {OP_FORMAT}, and the log holds an entry of format {OP_FORMAT + 1}" in log
            assert "upgrade this replica" in log
            c._reap(r, 5)
        # Restarted with the same (older) code it stops at the same entry again.
        r = c.replicas[1]
        try:
            c.start(1)
        except AssertionError as exc:  # stopped before it answered
            assert "exited with 70" in str(exc)
        else:
            assert wait_for(lambda: r.proc.poll(), 30, "replica 1 to stop again") == 70  # type: ignore[union-attr]
            c._reap(r, 5)
        # Upgraded, both apply the log as the leader did and the cluster works.
        for i in (1, 2):
            c.replicas[i].env = dict(newer)
            c.start(i)
        c.wait_leader(30)
        asyncio.run(_mkdir(c, "/after-upgrade", read=("/made-by-newer", "/after-upgrade")))
        c.wait_converged(30)
    finally:
        c.close()


async def _mkdir(c: MetaCluster, path: str, *, read: tuple[str, ...] = ()) -> None:
    async with MetaClient(c.addresses, deadline=30.0) as mc:
        await mc.mkdir(path)
        for p in read:  # a linearizable read: needs a majority
            await mc.stat(p)
