"""Namespace semantics against a model.

A hypothesis RuleBasedStateMachine drives mkdir / create / symlink / rename /
unlink / rmdir / truncate / stat / readdir on a tiny path universe (so names
collide and every error path is hit) and compares each outcome, error class
included, with a plain dict model of a POSIX tree. The heavy run talks to the
state machine directly; a shorter run goes through the real gRPC service and
MetaClient. Runs are derandomized so CI is reproducible.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from meta_helpers import Driver, meta_server, register_async

from tierfs.errors import (
    AlreadyExistsError,
    DirectoryNotEmptyError,
    InvalidArgumentError,
    InvalidRenameError,
    IsADirectoryError_,
    NotADirectoryError_,
    NotFoundError,
    TierFSError,
)
from tierfs.meta import MetaClient, MetaStateMachine
from tierfs.proto.v1 import meta_pb2 as pb

KIND = {pb.INODE_TYPE_DIRECTORY: "dir", pb.INODE_TYPE_FILE: "file", pb.INODE_TYPE_SYMLINK: "link"}
# Few, mostly shallow names: operations collide often, so renames over
# non-empty directories, moves into a subtree and the like really happen.
paths = st.sampled_from(["/a", "/b", "/a/a", "/a/b", "/b/a", "/b/b", "/a/a/a", "/a/b/a", "/b/a/b", "/c"])
sizes = st.sampled_from([0, 1, 4 << 20, (4 << 20) + 1, 50 << 20])


def parent(p: str) -> str:
    return p.rsplit("/", 1)[0] or "/"


def join(d: str, name: str) -> str:
    return d.rstrip("/") + "/" + name


class Model:
    def __init__(self) -> None:
        self.kind: dict[str, str] = {"/": "dir"}
        self.size: dict[str, int] = {}

    def children(self, d: str) -> list[str]:
        return sorted(p.rsplit("/", 1)[1] for p in self.kind if p != "/" and parent(p) == d)

    def walk(self, path: str) -> str:
        cur = "/"
        for comp in [c for c in path.split("/") if c]:
            if self.kind[cur] != "dir":
                raise NotADirectoryError_()
            nxt = join(cur, comp)
            if nxt not in self.kind:
                raise NotFoundError()
            cur = nxt
        return cur

    def entry(self, path: str) -> None:
        par = self.walk(parent(path))
        if self.kind[par] != "dir":
            raise NotADirectoryError_()

    def make(self, path: str, kind: str) -> None:
        self.entry(path)
        if path in self.kind:
            raise AlreadyExistsError()
        self.kind[path] = kind
        if kind == "file":
            self.size[path] = 0

    def unlink(self, path: str) -> None:
        self.entry(path)
        if path not in self.kind:
            raise NotFoundError()
        if self.kind[path] == "dir":
            raise IsADirectoryError_()
        del self.kind[path]
        self.size.pop(path, None)

    def rmdir(self, path: str) -> None:
        self.entry(path)
        if path not in self.kind:
            raise NotFoundError()
        if self.kind[path] != "dir":
            raise NotADirectoryError_()
        if self.children(path):
            raise DirectoryNotEmptyError()
        del self.kind[path]

    def rename(self, src: str, dst: str) -> None:
        self.entry(src)
        self.entry(dst)
        if src not in self.kind:
            raise NotFoundError()
        if src == dst:
            return
        sk = self.kind[src]
        dp = parent(dst)
        if sk == "dir" and (dp == src or dp.startswith(src + "/")):
            raise InvalidRenameError()
        if dst in self.kind:
            dk = self.kind[dst]
            if sk == "dir" and dk != "dir":
                raise NotADirectoryError_()
            if sk != "dir" and dk == "dir":
                raise IsADirectoryError_()
            if dk == "dir" and self.children(dst):
                raise DirectoryNotEmptyError()
            del self.kind[dst]
            self.size.pop(dst, None)
        moved = {p: k for p, k in self.kind.items() if p == src or p.startswith(src + "/")}
        for p, k in moved.items():
            del self.kind[p]
            q = dst + p[len(src):]
            self.kind[q] = k
            if p in self.size:
                self.size[q] = self.size.pop(p)

    def truncate(self, path: str, size: int) -> None:
        p = self.walk(path)
        if self.kind[p] == "dir":
            raise IsADirectoryError_()
        if self.kind[p] != "file":
            raise InvalidArgumentError()
        self.size[p] = size


class DirectSUT:
    def __init__(self) -> None:
        self.d = Driver()
        self.d.register()

    def op(self, name: str, *a: Any) -> None:
        L = pb.Loc
        d = self.d
        d.advance(0.001)
        if name == "mkdir":
            d.do("mkdir", pb.MkdirRequest(loc=L(path=a[0])))
        elif name == "create":
            d.do("create", pb.CreateRequest(loc=L(path=a[0])))
        elif name == "symlink":
            d.do("symlink", pb.SymlinkRequest(loc=L(path=a[0]), target="/x"))
        elif name == "unlink":
            d.do("unlink", pb.UnlinkRequest(loc=L(path=a[0])))
        elif name == "rmdir":
            d.do("rmdir", pb.RmdirRequest(loc=L(path=a[0])))
        elif name == "rename":
            d.do("rename", pb.RenameRequest(src=L(path=a[0]), dst=L(path=a[1])))
        elif name == "truncate":
            d.do("truncate", pb.TruncateRequest(loc=L(path=a[0]), size=a[1]))

    def stat(self, path: str) -> pb.FileInfo:
        return self.d.sm.stat(pb.Loc(path=path))

    def listdir(self, path: str) -> list[tuple[str, str]]:
        return [(e.name, KIND[e.attr.type]) for e in self.d.sm.readdir(pb.Loc(path=path), limit=10_000).entries]

    def close(self) -> None:
        # Determinism and snapshots hold for whatever history the run made.
        replica = MetaStateMachine()
        for op in self.d.log:
            replica.apply(op)
        assert replica.digest() == self.d.sm.digest()
        restored = MetaStateMachine()
        restored.restore(self.d.sm.snapshot())
        assert restored.digest() == self.d.sm.digest()


class GrpcSUT:
    def __init__(self) -> None:
        self.runner = asyncio.Runner()
        self.stack = contextlib.AsyncExitStack()
        self.mc: MetaClient = self.runner.run(self._start())

    async def _start(self) -> MetaClient:
        mc, _svc, _addr = await self.stack.enter_async_context(meta_server())
        await register_async(mc)
        return mc

    def op(self, name: str, *a: Any) -> None:
        self.runner.run(getattr(self.mc, name)(*a))

    def stat(self, path: str) -> pb.FileInfo:
        return self.runner.run(self.mc.stat(path))  # type: ignore[no-any-return]

    def listdir(self, path: str) -> list[tuple[str, str]]:
        async def ls() -> list[tuple[str, str]]:
            return [(e.name, KIND[e.attr.type]) async for e in self.mc.iterdir(path, page=2)]
        return self.runner.run(ls())  # type: ignore[no-any-return]

    def close(self) -> None:
        try:
            self.runner.run(self.stack.aclose())
        finally:
            self.runner.close()


class NamespaceMachine(RuleBasedStateMachine):
    sut_cls: type = DirectSUT
    full_check = True

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.sut = self.sut_cls()

    def teardown(self) -> None:
        self.sut.close()

    def both(self, name: str, *args: Any) -> None:
        want: type[TierFSError] | None = None
        try:
            getattr(self.model, name)(*args)
        except TierFSError as e:
            want = type(e)
        try:
            self.sut.op(name, *args)
            got: type[TierFSError] | None = None
        except TierFSError as e:
            got = type(e)
        assert got is want, f"{name}{args}: model says {want and want.__name__}, meta says {got and got.__name__}"

    @rule(data=st.data())
    def mkdir(self, data: st.DataObject) -> None:
        self._make(self.pick_new(data), "mkdir", "dir")

    @rule(data=st.data())
    def create(self, data: st.DataObject) -> None:
        self._make(self.pick_new(data), "create", "file")

    @rule(data=st.data())
    def symlink(self, data: st.DataObject) -> None:
        self._make(self.pick_new(data), "symlink", "link")

    def _make(self, p: str, op: str, kind: str) -> None:
        want: type[TierFSError] | None = None
        try:
            self.model.make(p, kind)
        except TierFSError as e:
            want = type(e)
        try:
            if op == "symlink":
                self.sut.op("symlink", p, "/x")
            else:
                self.sut.op(op, p)
            got: type[TierFSError] | None = None
        except TierFSError as e:
            got = type(e)
        assert got is want, f"{op}({p}): model says {want and want.__name__}, meta says {got and got.__name__}"

    def pick(self, data: st.DataObject, existing_only: bool = False) -> str:
        """Mostly a path that exists now (so ops succeed and trees grow),
        sometimes any path of the universe (so the error paths run too)."""
        live = sorted(p for p in self.model.kind if p != "/")
        if live and (existing_only or not data.draw(st.booleans())):
            return data.draw(st.sampled_from(live))
        return data.draw(paths)

    def pick_new(self, data: st.DataObject) -> str:
        """Mostly a new name in an existing directory (trees grow deep),
        sometimes any path of the universe."""
        if data.draw(st.booleans()):
            return data.draw(paths)
        dirs = sorted(p for p, k in self.model.kind.items() if k == "dir" and p.count("/") < 4)
        return join(data.draw(st.sampled_from(dirs)), data.draw(st.sampled_from("abc")))

    @rule(data=st.data())
    def unlink(self, data: st.DataObject) -> None:
        self.both("unlink", self.pick(data))

    @rule(data=st.data())
    def rmdir(self, data: st.DataObject) -> None:
        self.both("rmdir", self.pick(data))

    @rule(data=st.data())
    def rename(self, data: st.DataObject) -> None:
        self.both("rename", self.pick(data, existing_only=True), self.pick(data))

    @rule(data=st.data(), size=sizes)
    def truncate(self, data: st.DataObject, size: int) -> None:
        self.both("truncate", self.pick(data), size)

    @rule(p=paths)
    def stat(self, p: str) -> None:
        try:
            path = self.model.walk(p)
        except TierFSError as e:
            with pytest.raises(type(e)):
                self.sut.stat(p)
            return
        info = self.sut.stat(p)
        assert KIND[info.attr.type] == self.model.kind[path]
        if self.model.kind[path] == "file":
            assert info.attr.size == self.model.size[path]

    @rule(p=paths)
    def readdir(self, p: str) -> None:
        try:
            path = self.model.walk(p)
            if self.model.kind[path] != "dir":
                raise NotADirectoryError_()
        except TierFSError as e:
            with pytest.raises(type(e)):
                self.sut.listdir(p)
            return
        assert [n for n, _ in self.sut.listdir(p)] == self.model.children(path)

    @invariant()
    def tree_matches(self) -> None:
        if not self.full_check:
            return
        todo = ["/"]
        seen = 0
        while todo:
            d = todo.pop()
            entries = self.sut.listdir(d)
            assert [n for n, _ in entries] == self.model.children(d), d
            subdirs = 0
            for name, kind in entries:
                p = join(d, name)
                seen += 1
                assert kind == self.model.kind[p], p
                if kind == "dir":
                    todo.append(p)
                    subdirs += 1
            assert self.sut.stat(d).attr.nlink == 2 + subdirs, d
        assert seen == len(self.model.kind) - 1


class GrpcNamespaceMachine(NamespaceMachine):
    sut_cls = GrpcSUT
    full_check = False


@pytest.mark.timeout(90)
def test_namespace_matches_model_direct() -> None:
    s = settings(max_examples=100, stateful_step_count=50, derandomize=True, deadline=None,
                 suppress_health_check=list(HealthCheck))
    NamespaceMachine.TestCase.settings = s
    NamespaceMachine.TestCase().runTest()


@pytest.mark.timeout(90)
def test_namespace_matches_model_over_grpc() -> None:
    s = settings(max_examples=15, stateful_step_count=30, derandomize=True, deadline=None,
                 suppress_health_check=list(HealthCheck))
    GrpcNamespaceMachine.TestCase.settings = s
    GrpcNamespaceMachine.TestCase().runTest()
