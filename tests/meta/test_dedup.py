"""The retry-dedup table is bounded in total (entries and bytes), per client
and per entry, and evicts deterministically: least recently active client
first, the same on a replica that restored a snapshot half-way."""

from __future__ import annotations

import pytest
from meta_helpers import Driver

from tierfs.errors import InternalError, error_from_code
from tierfs.meta import MetaStateMachine, dedup
from tierfs.meta.dedup import RequestTable
from tierfs.proto.v1 import meta_pb2 as pb

pytestmark = pytest.mark.timeout(60)


def _mkdir(d: Driver, path: str, client: str, rid: int) -> bytes:
    return d.raw("mkdir", pb.MkdirRequest(loc=pb.Loc(path=path)), client=client, rid=rid)


def test_total_entries_are_bounded_and_the_least_recently_active_go_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dedup, "MAX_ENTRIES", 40)
    d = Driver()
    first = _mkdir(d, "/keep", "keeper", 1)
    for i in range(60):
        _mkdir(d, f"/d{i}", f"client-{i}", 1)
        if i % 10 == 0:
            _mkdir(d, f"/k{i}", "keeper", 2 + i)  # keeper stays recently active
    t = d.sm.requests
    assert t.entries <= 40 and len(t) <= 40
    assert "keeper" in t and "client-0" not in t and "client-59" in t
    # the keeper's first request is still answered from the table, not re-applied
    assert _mkdir(d, "/keep", "keeper", 1) == first
    # a forgotten client's retry is applied again (here: the name exists now)
    res = pb.MetaResult.FromString(_mkdir(d, "/d0", "client-0", 1))
    assert res.error.code != 0


def test_eviction_is_identical_on_a_replica_restored_half_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dedup, "MAX_ENTRIES", 25)
    d = Driver()
    for i in range(30):
        _mkdir(d, f"/a{i}", f"c{i % 13}", i + 1)
    replica = MetaStateMachine()
    replica.restore(d.sm.snapshot())
    mark = len(d.log)
    for i in range(30, 90):
        d.advance(0)  # equal clocks: order, not time, decides
        _mkdir(d, f"/a{i}", f"c{(i * 7) % 17}", i + 1)
    for op in d.log[mark:]:
        replica.apply(op)
    assert replica.digest() == d.sm.digest()
    assert replica.requests.to_json() == d.sm.requests.to_json()


def test_bytes_are_bounded_and_an_oversized_result_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dedup, "MAX_RESULT_BYTES", 50)
    d = Driver()
    d.register()
    out = d.raw("create", pb.CreateRequest(loc=pb.Loc(path="/big")), client="c", rid=1)
    assert len(out) > 50  # a FileInfo with its layout
    again = pb.MetaResult.FromString(d.raw("create", pb.CreateRequest(loc=pb.Loc(path="/big")), client="c", rid=1))
    err = error_from_code(again.error.code, again.error.message)
    assert isinstance(err, InternalError) and "already applied" in err.message
    assert d.sm.requests.bytes == 0 and d.sm.requests.entries == 1
    # and the marker survives a snapshot
    replica = MetaStateMachine()
    replica.restore(d.sm.snapshot())
    assert replica.digest() == d.sm.digest()

    t = RequestTable()
    monkeypatch.setattr(dedup, "MAX_BYTES", 1000)
    for i in range(50):
        t.remember(f"c{i}", 1, b"x" * 40, clock=i)
    assert t.bytes <= 1000 and "c49" in t and "c0" not in t


def test_per_client_cap_and_idle_expiry() -> None:
    t = RequestTable()
    for r in range(1, dedup.REQUESTS_PER_CLIENT + 11):
        t.remember("c", r, b"ok", clock=min(r, 10))
    assert t.entries == dedup.REQUESTS_PER_CLIENT
    assert t.lookup("c", 10) == (False, None, None) and t.lookup("c", 11) == (True, b"ok", None)
    t.remember("d", 1, b"ok", clock=1000)
    assert t.expire_due(500)
    t.expire(500)
    assert "c" not in t and "d" in t and t.entries == 1 and not t.expire_due(500)


def test_a_kept_reply_answers_only_the_op_kind_it_answered() -> None:
    """Ops of format 4 on (DEDUP_BOUND_FORMAT) bind each kept reply to the
    op's kind and caller: a repeat of the id for another kind is refused
    and changes nothing; a true retry gets the first reply. The bindings
    survive a snapshot, and entries of older leaders replay as they did."""
    from tierfs.meta.state import DEDUP_BOUND_FORMAT

    d = Driver()
    d.min_format = 0  # an older leader's entries: no binding
    first = _mkdir(d, "/old", "c", 1)
    assert _apply_rmdir(d, "/old", "c", 1) == first  # answered, not applied (as before)
    assert d.sm.requests.prints_to_json() == []
    d.min_format = DEDUP_BOUND_FORMAT
    made = _mkdir(d, "/new", "c", 2)
    assert _mkdir(d, "/new", "c", 2) == made  # a retry
    before = d.sm.digest()
    res = pb.MetaResult.FromString(_apply_rmdir(d, "/new", "c", 2))
    err = error_from_code(res.error.code, res.error.message)
    assert "already used for another request" in err.message, err
    assert d.sm.digest() == before  # clock included
    replica = MetaStateMachine()
    replica.restore(d.sm.snapshot())
    assert replica.digest() == d.sm.digest()
    assert replica.requests.prints_to_json() == d.sm.requests.prints_to_json() != []
    # an older entry's reply (kept without a binding) still answers a repeat
    assert pb.MetaResult.FromString(_apply_rmdir(d, "/old", "c", 1)).error.code == 0


def _apply_rmdir(d: Driver, path: str, client: str, rid: int) -> bytes:
    return d.raw("rmdir", pb.RmdirRequest(loc=pb.Loc(path=path)), client=client, rid=rid)


def test_the_window_is_wider_for_ops_of_the_window_format() -> None:
    """Ops of format 5 on (DEDUP_WINDOW_FORMAT) keep a client's last 4096
    results, more than a Batch call's items; entries of older leaders keep
    the 128 they did (a replica replaying them must evict as they did)."""
    from tierfs.meta.state import DEDUP_WINDOW_FORMAT

    for fmt, kept in ((DEDUP_WINDOW_FORMAT - 1, dedup.REQUESTS_PER_CLIENT_OLD),
                      (DEDUP_WINDOW_FORMAT, 300)):
        d = Driver()
        d.min_format = fmt
        first = _mkdir(d, "/a0", "c", 1)
        for i in range(1, 300):
            _mkdir(d, f"/a{i}", "c", 1 + i)
        assert d.sm.requests.entries == kept
        again = _mkdir(d, "/a0", "c", 1)
        assert (again == first) is (kept == 300), fmt
