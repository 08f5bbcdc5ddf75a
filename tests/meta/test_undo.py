"""The undo log (tierfs/meta/undo.py): every mutation of tracked state made
inside a transaction is undone when it raises."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.meta.undo import TDict, TList, Tracked, TSet, transaction


@dataclass(slots=True)
class Rec(Tracked):
    a: int = 0
    items: dict[int, int] = field(default_factory=dict)
    tags: set[int] = field(default_factory=set)


class Boom(Exception):
    pass


def plain(x: Any) -> Any:
    """A structural, untracked copy for comparisons."""
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, set):
        return set(x)
    if isinstance(x, list):
        return [plain(v) for v in x]
    if isinstance(x, tuple):
        return tuple(plain(v) for v in x)
    if isinstance(x, Rec):
        return ("Rec", x.a, plain(x.items), plain(x.tags))
    return x


keys = st.integers(0, 6)
vals = st.integers(0, 100)
dict_ops = st.one_of(
    st.tuples(st.just("set"), keys, vals),
    st.tuples(st.just("del"), keys, vals),
    st.tuples(st.just("pop"), keys, vals),
    st.tuples(st.just("setdefault_set"), keys, vals),
    st.tuples(st.just("update"), keys, vals),
    st.tuples(st.just("clear"), keys, vals),
    st.tuples(st.just("popitem"), keys, vals),
    st.tuples(st.just("nested_add"), keys, vals),
    st.tuples(st.just("set_add"), keys, vals),
    st.tuples(st.just("set_discard"), keys, vals),
    st.tuples(st.just("set_update"), keys, vals),
    st.tuples(st.just("set_isub"), keys, vals),
    st.tuples(st.just("set_iand"), keys, vals),
    st.tuples(st.just("set_pop"), keys, vals),
    st.tuples(st.just("list_append"), keys, vals),
    st.tuples(st.just("list_setitem"), keys, vals),
    st.tuples(st.just("list_pop"), keys, vals),
    st.tuples(st.just("list_sort"), keys, vals),
    st.tuples(st.just("list_del_slice"), keys, vals),
    st.tuples(st.just("rec_attr"), keys, vals),
    st.tuples(st.just("rec_items"), keys, vals),
    st.tuples(st.just("rec_replace_items"), keys, vals),
    st.tuples(st.just("rec_new"), keys, vals),
    st.tuples(st.just("tuple_dict"), keys, vals),
)


class State(Tracked):
    def __init__(self) -> None:
        self.counter = 0
        self.d: dict[int, Any] = {}
        self.s: set[int] = set()
        self.lst: list[int] = []
        self.recs: dict[int, Rec] = {}


def run(state: State, ops: list[tuple[str, int, int]]) -> None:
    d, s, lst = state.d, state.s, state.lst
    for kind, k, v in ops:
        state.counter += 1
        if kind == "set":
            d[k] = v
        elif kind == "del" and k in d:
            del d[k]
        elif kind == "pop":
            d.pop(k, None)
        elif kind == "setdefault_set":
            x = d.setdefault(("s", k), set())
            if isinstance(x, set):
                x.add(v)
        elif kind == "update":
            d.update({k: v, k + 1: [v]})
        elif kind == "clear" and v % 7 == 0:
            d.clear()
        elif kind == "popitem" and d:
            d.popitem()
        elif kind == "nested_add":
            x = d.get(k + 1)
            if isinstance(x, list):
                x.append(v)
        elif kind == "set_add":
            s.add(k)
        elif kind == "set_discard":
            s.discard(k)
        elif kind == "set_update":
            s.update({k, v})
        elif kind == "set_isub":
            s -= {k}
        elif kind == "set_iand":
            s &= {k, v, 1, 2, 3}
        elif kind == "set_pop" and len(s) == 1:  # pop order depends on history
            s.pop()
        elif kind == "list_append":
            lst.append(v)
        elif kind == "list_setitem" and lst:
            lst[k % len(lst)] = v
        elif kind == "list_pop" and lst:
            lst.pop(k % len(lst))
        elif kind == "list_sort":
            lst.sort(reverse=bool(v % 2))
        elif kind == "list_del_slice":
            del lst[: k % 3]
        elif kind == "rec_attr" and k in state.recs:
            state.recs[k].a = v
        elif kind == "rec_items" and k in state.recs:
            state.recs[k].items[v] = k
            state.recs[k].tags.add(v)
        elif kind == "rec_replace_items" and k in state.recs:
            state.recs[k].items = {v: v}
        elif kind == "rec_new":
            state.recs[k] = Rec(a=v)
        elif kind == "tuple_dict":
            t = d.get(("t", k))
            if isinstance(t, tuple):
                t[1][v] = k
            else:
                d[("t", k)] = (v, {v: v})


@settings(max_examples=300, deadline=None)
@given(st.lists(dict_ops, max_size=30), st.lists(dict_ops, max_size=30))
def test_rollback_restores_everything(setup: list[tuple[str, int, int]], ops: list[tuple[str, int, int]]) -> None:
    state = State()
    run(state, setup)  # outside a transaction: records nothing
    before = plain(vars(state))
    with pytest.raises(Boom), transaction():
        run(state, ops)
        raise Boom
    assert plain(vars(state)) == before
    # The containers are still tracked after a rollback: a second failed
    # transaction is undone as well, a successful one sticks.
    with pytest.raises(Boom), transaction():
        run(state, ops)
        raise Boom
    assert plain(vars(state)) == before
    with transaction():
        run(state, ops)
    after = State()
    run(after, setup)
    run(after, ops)
    assert plain(vars(state)) == plain(vars(after))


def test_plain_containers_are_converted_when_stored() -> None:
    state = State()
    state.d[1] = {2: {3}}
    assert isinstance(state.d[1], TDict) and isinstance(state.d[1][2], TSet)
    state.d[2] = (1, [2])
    assert isinstance(state.d[2][1], TList)
    r = Rec()
    assert isinstance(r.items, TDict) and isinstance(r.tags, TSet)
    assert isinstance(state.recs, TDict)


def test_new_attribute_is_removed_on_rollback() -> None:
    state = State()
    with pytest.raises(Boom), transaction():
        state.extra = {1: 2}  # type: ignore[attr-defined]
        raise Boom
    assert not hasattr(state, "extra")


def test_transactions_do_not_nest() -> None:
    with transaction(), pytest.raises(RuntimeError), transaction():
        pass


def test_deepcopy_of_tracked_state_is_equal() -> None:
    state = State()
    run(state, [("set", 1, 2), ("rec_new", 3, 4), ("rec_items", 3, 5)])
    assert plain(vars(copy.deepcopy(state))) == plain(vars(state))


def test_a_failed_create_leaves_no_trace_of_the_new_inode() -> None:
    # new_object() skips recording a new inode's own fields: the rollback
    # must still drop it, and undo what was changed once it was stored.
    from tierfs.meta.state import MetaStateMachine
    from tierfs.proto.v1 import meta_pb2 as pb

    sm = MetaStateMachine()

    def mkdir(path: str, rid: int) -> pb.MetaResult:
        op = pb.MetaOp(now_ns=10**18 + rid, client_id="c", request_id=rid, mkdir=pb.MkdirRequest(loc=pb.Loc(path=path)))
        return pb.MetaResult.FromString(sm.apply(op.SerializeToString(deterministic=True)))

    assert not mkdir("/a", 1).error.code
    before, inodes, nxt = sm.digest(), set(sm.inodes), sm.next_inode
    sm._fail_marker = b"boom"
    assert mkdir("/a/boom", 2).error.code
    assert (sm.digest(), set(sm.inodes), sm.next_inode) == (before, inodes, nxt)
    sm._fail_marker = b""
    assert not mkdir("/a/boom", 3).error.code and sm.next_inode == nxt + 1
