"""The model-based checker of the metadata service: seeded random walks of
namespace operations against three real meta replicas (Raft), with
replicas SIGKILLed, stopped (SIGSTOP), resumed, restarted, the leader
killed, all three killed at once and restarted, and snapshots forced, while
a model of the namespace predicts every answer.

What it checks:

* every acknowledged mutation is there, exactly as the model has it, at
  every later observation: after failovers, after all replicas crash at
  once, after snapshots (nothing acknowledged is lost);
* every answer is the model's: an operation the model says succeeds
  succeeds (a retry after a lost reply is deduplicated, never answered
  "already exists" or "not found"), one the model says fails fails and
  changes nothing;
* an inode keeps its number through renames;
* at the end, every replica's state digest is the same.

An operation that fails with an error that leaves its outcome open
(unavailable, timeout, no leader) is *pending*: it may have been applied or
not, and may still be applied later, but only once, and only as a whole. The
walk touches none of its paths until a ``settle``: all replicas running, a
leader, a barrier mutation acknowledged, and the pending calls' deadlines
past. From then on the state observed is the state, and an operation that
was not applied by then must never appear later.

Operations (paths are relative to the walk's root; ``d*`` are directories,
``f*`` names for files and symlinks, at the top or one level down):

==========================================  =====================================================
``("mkdir", d)``, ``("rmdir", d)``          top-level directories only
``("create", p, mode)``                     an empty file
``("symlink", p, target)``, ``("unlink", p)``
``("rename", src, dst)``                    files and links over files and links, directories
                                            over empty directories, POSIX rules
``("truncate", p, size)``, ``("chmod", p, mode)``
``("write", p, size)``                      open a write session and commit ``size`` bytes of chunk
                                            records (meta never sees data: there are no storage
                                            daemons); the records are checked at every ``stat``
``("burst", [op, ...])``                    independent file operations in flight at once (they
                                            travel in one Batch call)
``("storm", [op, ...], how, who, ms)``      a burst, and ``ms`` after it is sent replica ``who``
                                            (or "leader") killed or stopped (``how``)
``("stat", p)``, ``("list", d)``            ``d`` "" is the root
``("check",)``                              every path, and every directory's listing
``("kill", i)``, ``("stop", i)``, ``("cont", i)``, ``("start", i)``   replica ``i``
``("kill_leader",)``                        logged as the ``("kill", i)`` it became
``("crash_all",)``                          SIGKILL every replica, start them all again
``("snapshot", i)``                         force a snapshot (log compaction) on replica ``i``
``("replace", i, dead)``                    a new replica added to the group, caught up, then
                                            member ``i`` removed and SIGKILLed (``dead``: SIGKILLed
                                            before the new one is started)
``("settle",)``                             resolve every pending operation (above)
``("cut", i, j)``, ``("cut_client", i)``    partitions (a cluster of hosts, tests/hosts.py's
``("isolate", i)``, ``("mend",)``           HostMetaCluster, only): the link between replicas
                                            ``i`` and ``j`` cut, replica ``i`` cut from the walk's
                                            client (it reaches the others), replica ``i`` cut from
                                            every other replica (its clients still reach it), every
                                            cut mended; ``("isolate_leader",)`` is logged as the
                                            ``("isolate", i)`` it became. A settle mends them all.
==========================================  =====================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.checker.walk import CheckFailed, listing, own_failure, save_log
from tests.cluster import MetaCluster
from tierfs.chunk import generation
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
from tierfs.meta import MetaClient
from tierfs.proto.v1 import meta_pb2 as pb

__all__ = ["MetaChecker", "meta_random_ops", "meta_walk_cluster", "run_meta_walk"]

Op = tuple[Any, ...]
#: A path's state: ("dir", ino) | ("file", ino, size, mode, chunks) | ("link", ino, target); ino 0: not
#: known yet; chunks: ((index, generation), ...) of the last commit, None: not known (after a truncate).
State = tuple[Any, ...]

DIRS = ("d0", "d1", "d2")
NAMES = ("f0", "f1", "f2", "f3")
#: Errors that say what happened: the operation was refused and changed nothing.
DEFINITE: tuple[type[TierFSError], ...] = (
    NotFoundError, AlreadyExistsError, NotADirectoryError_, IsADirectoryError_, DirectoryNotEmptyError,
    InvalidArgumentError, InvalidRenameError)
#: The walk's client gives up on a call after this long: an operation left
#: pending is sealed (applied or never) this long after it was sent, plus
#: an election's worth of margin.
DEADLINE = 4.0
SEAL_MARGIN = 2.0
FATAL = ("lost", "wrong-state", "unexpected-success", "unexpected-error", "api", "diverged", "stuck")


def parent_of(p: str) -> str:
    return p.rsplit("/", 1)[0] if "/" in p else ""


class Pending:
    """An operation whose outcome is open: ``before`` and ``after`` are the
    states of its paths if it was not / was applied."""

    def __init__(self, op: Op, before: dict[str, State | None], after: dict[str, State | None],
                 sent: float, hold: bool = False) -> None:
        """``hold``: resolved only by a settle (a write session that may be
        open holds the file until its lease runs out)."""
        self.op, self.before, self.after, self.sent, self.hold = op, before, after, sent, hold

    @property
    def paths(self) -> set[str]:
        return set(self.before) | set(self.after)


@dataclass
class MetaChecker:
    cluster: MetaCluster
    root: str
    seed: int | None = None
    log: list[Op] = field(default_factory=list)
    model: dict[str, State] = field(default_factory=dict)  # acknowledged state (pending ops not applied)
    pending: list[Pending] = field(default_factory=list)
    sealed: list[Op] = field(default_factory=list)  # pending ops found not applied at a settle
    down: dict[int, str] = field(default_factory=dict)  # replica -> "killed" | "stopped"
    violations: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    log_dir: Path | None = None
    mc: MetaClient | None = None
    members: list[int] = field(default_factory=list)  # replica indexes in the Raft group
    #: links cut (partitions): (i, j) between replicas, (i, -1) between replica i and the walk's client
    cuts: set[tuple[int, int]] = field(default_factory=set)

    @property
    def partitions(self) -> bool:
        """Whether the cluster can cut links (its replicas run on hosts of their own)."""
        return hasattr(self.cluster, "cut")

    def client(self) -> MetaClient:
        return MetaClient([self.cluster.addresses[i] for i in self.members], deadline=DEADLINE,
                          attempt_timeout=1.5)

    # ---- running ---------------------------------------------------------------------

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def p(self, path: str) -> str:
        return f"{self.root}/{path}" if path else self.root

    async def run(self, ops: Iterator[Op] | Sequence[Op], *, finish: bool = True) -> None:
        t0 = time.monotonic()
        if not self.members:
            self.members = [r.index for r in self.cluster.replicas if r.alive]
        self.mc = self.client()
        try:
            with contextlib.suppress(AlreadyExistsError):
                await self.mc.mkdir(self.root)
            for op in ops:
                self.log.append(op)
                await self.step(op)
            if finish:
                await self.finish()
        except CheckFailed:
            raise
        except Exception as exc:
            self.violation("unexpected-error", own_failure(exc, len(self.log)))
        finally:
            self.counts["seconds"] = round(time.monotonic() - t0)
            await self.mc.close()
        if self.violations:
            raise CheckFailed(self.report())

    async def step(self, op: Op) -> None:
        self.count(op[0])
        fn = getattr(self, "op_" + op[0], None)
        if fn is not None:
            await fn(*op[1:])
        else:
            await self.mutate(op)

    def violation(self, kind: str, msg: str) -> None:
        self.violations.append(f"[{kind}] step {len(self.log)} {self.log[-1] if self.log else ''}: {msg}")
        self.count("violation:" + kind)
        if kind in FATAL:
            raise CheckFailed(self.report())

    def report(self) -> str:
        path = save_log(self.log_dir, f"meta-checker-seed{self.seed}.json", self.root, self.seed, self.log,
                        self.violations)
        return (f"meta checker: {len(self.violations)} violation(s) in {self.root} (seed {self.seed}, "
                f"{len(self.log)} steps)\n" + "\n".join(self.violations)
                + f"\npending: {[pd.op for pd in self.pending]}; sealed unapplied: {self.sealed[-5:]}"
                + f"\ncounts: {dict(sorted(self.counts.items()))}"
                + f"\nop log{f' (saved to {path})' if path else ''}:\n" + listing(self.log))

    # ---- the model -------------------------------------------------------------------

    def busy(self) -> set[str]:
        """Paths the walk must not touch while operations on them are pending:
        theirs, their parents, and everything under a pending directory."""
        out: set[str] = set()
        for pd in self.pending:
            for q in pd.paths:
                out.add(q)
                out.add(parent_of(q))
        return out

    def touches_busy(self, op: Op) -> bool:
        busy = self.busy()
        if op[0] in ("burst", "storm"):
            return any(self.touches_busy(o) for o in op[1])
        paths = [a for a in op[1:3] if isinstance(a, str)] if op[0] == "rename" else [op[1]]
        for q in paths:
            if q in busy or parent_of(q) in busy or any(b.startswith(q + "/") for b in busy):
                return True
        return False

    def predict(self, op: Op) -> tuple[type[TierFSError] | None, dict[str, State | None]]:
        """What ``op`` does to the model: the error the model expects (None:
        success) and the new states of the paths it changes."""
        kind, m = op[0], self.model
        p = op[1]
        par = parent_of(p)
        par_state = m.get(par) if par else ("dir", 0)
        if kind in ("mkdir", "create", "symlink"):
            if par_state is None:
                return NotFoundError, {}
            if par_state[0] != "dir":
                return NotADirectoryError_, {}
            if p in m:
                return AlreadyExistsError, {}
            new: State = (("dir", 0) if kind == "mkdir" else ("file", 0, 0, op[2], ()) if kind == "create"
                          else ("link", 0, op[2]))
            return None, {p: new}
        st = m.get(p)
        if kind == "rmdir":
            if st is None:
                return NotFoundError, {}
            if st[0] != "dir":
                return NotADirectoryError_, {}
            if any(q.startswith(p + "/") for q in m):
                return DirectoryNotEmptyError, {}
            return None, {p: None}
        if kind == "unlink":
            if st is None:
                return NotFoundError, {}
            if st[0] == "dir":
                return IsADirectoryError_, {}
            return None, {p: None}
        if kind == "truncate":
            if st is None:
                return NotFoundError, {}
            if st[0] != "file":
                return IsADirectoryError_ if st[0] == "dir" else InvalidArgumentError, {}
            return None, {p: ("file", st[1], op[2], st[3], () if op[2] == 0 else None)}
        if kind == "write":
            return self.predict(("truncate", p, op[2]))
        if kind == "chmod":
            if st is None:
                return NotFoundError, {}
            if st[0] != "file":
                return InvalidArgumentError, {}  # the walk chmods only files (not predicted for others)
            return None, {p: ("file", st[1], st[2], op[2], st[4])}
        if kind == "rename":
            dst = op[2]
            if st is None:
                return NotFoundError, {}
            dpar = parent_of(dst)
            dpar_state = m.get(dpar) if dpar else ("dir", 0)
            if dpar_state is None:
                return NotFoundError, {}
            if dpar_state[0] != "dir":
                return NotADirectoryError_, {}
            if dst == p:
                return None, {}
            victim = m.get(dst)
            if st[0] == "dir" and (dst + "/").startswith(p + "/"):
                return InvalidRenameError, {}
            if victim is not None:
                if st[0] == "dir" and victim[0] != "dir":
                    return NotADirectoryError_, {}
                if st[0] != "dir" and victim[0] == "dir":
                    return IsADirectoryError_, {}
                if victim[0] == "dir" and any(q.startswith(dst + "/") for q in m):
                    return DirectoryNotEmptyError, {}
            changes: dict[str, State | None] = {p: None, dst: st}
            for q, s in m.items():
                if q.startswith(p + "/"):
                    changes[q] = None
                    changes[dst + q[len(p):]] = s
            return None, changes
        raise AssertionError(f"unknown op {op!r}")

    def apply(self, changes: dict[str, State | None]) -> None:
        for q, s in changes.items():
            if s is None:
                self.model.pop(q, None)
            else:
                self.model[q] = s

    # ---- mutations -------------------------------------------------------------------

    async def call(self, op: Op) -> pb.FileInfo | None:
        assert self.mc is not None
        kind, p = op[0], self.p(op[1])
        if kind == "mkdir":
            return await self.mc.mkdir(p)
        if kind == "create":
            return await self.mc.create(p, mode=op[2])
        if kind == "symlink":
            return await self.mc.symlink(p, op[2])
        if kind == "rmdir":
            await self.mc.rmdir(p)
        elif kind == "unlink":
            await self.mc.unlink(p)
        elif kind == "rename":
            await self.mc.rename(p, self.p(op[2]))
        elif kind == "truncate":
            return await self.mc.truncate(p, op[2])
        elif kind == "chmod":
            return await self.mc.setattr(p, mode=op[2])
        return None

    async def mutate(self, op: Op) -> None:
        sent = time.monotonic()
        want, changes = self.predict(op)
        try:
            info = await self.call(op)
        except DEFINITE as exc:
            if want is None:
                self.violation("api", f"refused ({type(exc).__name__}: {exc}) but the model has it succeed "
                               f"(a retry answered as if the first attempt were another caller's?)")
            elif not isinstance(exc, want):
                # Which error a refusal carries is not what this walk is about: counted, not fatal.
                self.count(f"other-error:{type(exc).__name__}-for-{want.__name__}")
            self.count("refused")
            self.count(f"refused:{op[0]}")
            return
        except TierFSError as exc:
            self.count(f"indeterminate:{type(exc).__name__}")
            if not self.down and not self.cuts:
                self.count("indeterminate_no_fault")
            if want is None and changes:
                before = {q: self.model.get(q) for q in changes}
                self.pending.append(Pending(op, before, changes, sent))
            return
        if want is not None:
            self.violation("unexpected-success", f"succeeded; the model expects {want.__name__}")
        self.count("acked")
        if info is not None and op[1] in changes and changes[op[1]] is not None:
            st = changes[op[1]]
            assert st is not None
            ino = int(info.attr.inode)
            if st[1] and st[1] != ino:
                self.violation("wrong-state", f"{op[1]} is inode {ino}, the model has {st[1]}")
            changes[op[1]] = (st[0], ino, *st[2:])
            self.check_info(op[1], info, changes[op[1]])
        self.apply(changes)

    async def op_write(self, path: str, size: int) -> None:
        """A write session: open, then commit ``size`` bytes in whole chunks
        (records only: meta does not see the data)."""
        assert self.mc is not None
        want, _ = self.predict(("truncate", path, size))  # the same rules: an existing file
        st = self.model.get(path)
        sent = time.monotonic()
        try:
            s = await self.mc.open_write(self.p(path), owner="meta-walk", lease_ms=3000)
        except DEFINITE as exc:
            if want is None:
                self.violation("api", f"open_write refused ({type(exc).__name__}: {exc}); the model has it succeed")
            self.count("refused")
            self.count("refused:write")
            return
        except TierFSError as exc:
            self.count(f"indeterminate:{type(exc).__name__}")
            if want is None:
                # A session may be open: the file is held until a settle.
                self.pending.append(Pending(("write", path, size), {path: st}, {path: st}, sent, hold=True))
            return
        if want is not None or st is None:
            self.violation("unexpected-success", f"open_write succeeded; the model expects {want}")
            return
        cs = int(s.file.layout.chunk_size)
        n = -(-size // cs)
        recs = [pb.ChunkRecord(index=i, generation=generation(s.data_version, 0), length=min(cs, size - i * cs))
                for i in range(n)]
        new: State = ("file", st[1], size, st[3], tuple((i, generation(s.data_version, 0)) for i in range(n)))
        try:
            info = await self.mc.commit_write(s.session_id, size, recs)
        except DEFINITE as exc:
            self.violation("api", f"commit_write of a session just opened refused ({type(exc).__name__}: {exc}) "
                           f"(a retry answered as if the first attempt were another caller's?)")
            return
        except TierFSError as exc:
            self.count(f"indeterminate:{type(exc).__name__}")
            self.pending.append(Pending(("write", path, size), {path: st}, {path: new}, sent, hold=True))
            return
        self.count("acked")
        self.check_info(path, info, new)
        self.apply({path: new})

    async def one(self, op: Sequence[Any]) -> None:
        """One operation of a burst."""
        await (self.op_write(op[1], op[2]) if op[0] == "write" else self.mutate(tuple(op)))

    async def op_burst(self, ops: Sequence[Op]) -> None:
        await asyncio.gather(*(self.one(o) for o in ops))

    async def op_storm(self, ops: Sequence[Op], how: str, who: int | str, delay_ms: int) -> None:
        """A burst with a replica killed or stopped ``delay_ms`` after it is
        sent: the leader (``who`` "leader", logged as the replica it was) or
        replica ``who``."""
        if who == "leader":
            leader = await asyncio.to_thread(self.cluster.leader)
            if leader is None:
                await self.op_burst(ops)
                return
            who = leader
            self.log[-1] = ("storm", ops, how, who, delay_ms)

        async def fault() -> None:
            await asyncio.sleep(delay_ms / 1000)
            await (self.op_kill if how == "kill" else self.op_stop)(int(who))

        await asyncio.gather(fault(), *(self.one(o) for o in ops))

    # ---- observations ----------------------------------------------------------------

    def check_info(self, path: str, info: pb.FileInfo, st: State | None) -> None:
        got = self.state_of(info)
        if not self.same(got, st):
            self.violation("wrong-state", f"the reply says {path} is {got}; the model has {st}")

    @staticmethod
    def state_of(info: pb.FileInfo, chunks: bool = True) -> State:
        a = info.attr
        if a.type == pb.INODE_TYPE_DIRECTORY:
            return ("dir", int(a.inode))
        if a.type == pb.INODE_TYPE_SYMLINK:
            return ("link", int(a.inode), info.symlink_target)
        recs = tuple((int(c.index), int(c.generation)) for c in info.chunks) if chunks else None
        return ("file", int(a.inode), int(a.size), int(a.mode) & 0o7777, recs)

    @staticmethod
    def same(got: State | None, want: State | None) -> bool:
        """The states agree (an inode number or chunk list not known on
        either side agrees with any)."""
        if got is None or want is None:
            return got is None and want is None
        if got[0] != want[0] or (got[1] and want[1] and got[1] != want[1]):
            return False
        if got[0] == "file":
            return got[2:4] == want[2:4] and (got[4] is None or want[4] is None or got[4] == want[4])
        return bool(got[2:] == want[2:])

    async def observe(self, path: str) -> State | bool | None:
        """The path's state on the cluster (None: absent); False: no answer."""
        assert self.mc is not None
        try:
            return self.state_of(await self.mc.stat(self.p(path)))
        except NotFoundError:
            return None
        except NotADirectoryError_:
            return None
        except TierFSError as exc:
            self.count(f"observe-failed:{type(exc).__name__}")
            return False

    def judge(self, path: str, got: State | None) -> None:
        """``got`` observed at ``path``: fine if it is the model's state, or
        the state a pending operation leaves either way."""
        for pd in self.pending:
            if path in pd.paths:
                if self.same(got, pd.after.get(path, pd.before.get(path))) and not pd.hold:
                    # Applied (it stays so: an operation applies once).
                    self.pending.remove(pd)
                    self.resolve(pd, applied=True)
                    return
                if self.same(got, pd.before.get(path, self.model.get(path))) or (
                        pd.hold and self.same(got, pd.after.get(path))):
                    return
                self.violation("wrong-state", f"{path} is {got}; a pending {pd.op} leaves "
                               f"{pd.before.get(path)} or {pd.after.get(path)}")
                return
        want = self.model.get(path)
        if self.same(got, want):
            if got is not None and want is not None and not want[1]:
                self.model[path] = (want[0], got[1], *want[2:])
            return
        kind = "lost" if want is not None and got is None else "wrong-state"
        recent = [op for op in self.sealed if isinstance(op, tuple)][-3:]
        self.violation(kind, f"{path} is {got}; the model has {want} (recently sealed unapplied: {recent})")

    def resolve(self, pd: Pending, applied: bool) -> None:
        self.count("pending-applied" if applied else "pending-not-applied")
        if applied:
            self.apply(pd.after)
        else:
            self.sealed.append(pd.op)

    async def op_stat(self, path: str) -> None:
        got = await self.observe(path)
        if got is not False:
            self.judge(path, got)

    async def op_list(self, d: str) -> None:
        assert self.mc is not None
        try:
            entries = {e.name: e for e in [e async for e in self.mc.iterdir(self.p(d))]}
        except (NotFoundError, NotADirectoryError_) as exc:
            st = self.model.get(d, ("dir", 0) if not d else None)
            if st is not None and st[0] == "dir" and not any(d in pd.paths for pd in self.pending):
                self.violation("lost", f"listing {d!r}: {type(exc).__name__}; the model has {st}")
            return
        except TierFSError as exc:
            self.count(f"observe-failed:{type(exc).__name__}")
            return
        prefix = d + "/" if d else ""
        names = {q[len(prefix):] for q in self.model if parent_of(q) == d}
        for pd in self.pending:
            names |= {q[len(prefix):] for q in pd.paths if parent_of(q) == d}
        for name in sorted(names | set(entries)):
            q = prefix + name
            if name in entries:
                e = entries[name]
                got = self.state_of(pb.FileInfo(attr=e.attr), chunks=False)
                if got[0] == "link":
                    # A listing carries no target: read it.
                    try:
                        got = self.state_of(await self.mc.stat(self.p(q)))
                    except TierFSError:
                        continue
                self.judge(q, got)
            else:
                self.judge(q, None)

    async def op_check(self) -> None:
        await self.op_list("")
        for d in sorted(q for q, st in self.model.items() if st[0] == "dir"):
            await self.op_list(d)

    # ---- faults ----------------------------------------------------------------------

    async def op_kill(self, i: int) -> None:
        if self.down.get(i) == "stopped":
            self.cont_proc(i)
        self.cluster.kill(i)
        self.down[i] = "killed"

    async def op_stop(self, i: int) -> None:
        import signal

        r = self.cluster.replicas[i]
        assert r.proc is not None
        r.proc.send_signal(signal.SIGSTOP)
        self.down[i] = "stopped"

    def cont_proc(self, i: int) -> None:
        import signal

        r = self.cluster.replicas[i]
        assert r.proc is not None
        r.proc.send_signal(signal.SIGCONT)

    async def op_cont(self, i: int) -> None:
        self.cont_proc(i)
        self.down.pop(i, None)

    async def op_start(self, i: int) -> None:
        self.cluster.start(i, timeout=60)
        self.down.pop(i, None)

    async def op_kill_leader(self) -> None:
        await self.to_leader("kill")

    async def to_leader(self, what: str) -> None:
        """``what`` (an op taking a replica) done to the leader, resolved
        now and logged as what it became: a replay does it to the same
        replica."""
        leader = await asyncio.to_thread(self.cluster.leader)
        self.log[-1] = (what, leader) if leader is not None else ("kill_leader_none",)
        if leader is not None:
            await getattr(self, "op_" + what)(leader)

    async def op_kill_leader_none(self) -> None:
        pass

    async def op_crash_all(self) -> None:
        for i in self.members:
            if self.down.get(i) == "stopped":
                self.cont_proc(i)
            self.cluster.kill(i)
        self.down.clear()
        for i in self.members:
            self.cluster.start(i, timeout=60)

    async def op_snapshot(self, i: int) -> None:
        if i in self.down:
            return
        try:
            await asyncio.to_thread(self.cluster.force_snapshot, i)
        except Exception as exc:  # a replica mid-election may refuse: counted
            self.count(f"snapshot-failed:{type(exc).__name__}")

    async def op_replace(self, i: int, dead: bool = False) -> None:
        """Replace member ``i``: start a new replica, add it to the group,
        wait until it has caught up, remove ``i`` and SIGKILL it. The other
        replicas are healed first (a change needs a working group); ``i``
        too, unless ``dead``: then it is SIGKILLed first, as when a replica
        is replaced because its machine died."""
        await self.heal()
        if dead:
            await self.op_kill(i)
        new = await asyncio.to_thread(self.cluster.add_replica)
        await asyncio.to_thread(self.change_member, "add", new)
        try:
            await asyncio.to_thread(self.cluster.wait_converged, 60,
                                    [*(m for m in self.members if not (dead and m == i)), new])
        except TimeoutError:
            digests = await asyncio.to_thread(self.cluster.digests)
            self.violation("stuck", f"replica {new}, just added, has not caught up in 60 s (state digest and "
                           f"applied index per replica: {digests}; its log: {self.cluster.log(new)[-600:]!r})")
        self.members.append(new)
        await asyncio.to_thread(self.change_member, "remove", i)
        self.cluster.kill(i)
        self.down.pop(i, None)
        self.members.remove(i)
        assert self.mc is not None
        await self.mc.close()
        self.mc = self.client()

    def change_member(self, how: str, i: int) -> None:
        """Add or remove replica ``i`` through the leader, retried through
        leader changes until the leader's member list shows it done."""
        addr = self.cluster.addresses[i]
        end = time.monotonic() + 60
        last: Exception | None = None
        while time.monotonic() < end:
            leader = self.cluster.leader()
            if leader is None or leader not in self.members:
                time.sleep(0.1)
                continue
            with contextlib.suppress(TierFSError):
                if (addr in self.cluster.status(leader).members) == (how == "add"):
                    return
            try:
                (self.cluster.add_member if how == "add" else self.cluster.remove_member)(leader, i)
            except TierFSError as exc:  # not the leader any more, a change in progress: again
                last = exc
                time.sleep(0.2)
        self.violation("unavailable", f"{how} member {i} not done within 60 s: {last}")

    # ---- partitions (HostMetaCluster) ------------------------------------------------

    def _cut(self, a: int, b: int) -> None:
        if (a, b) in self.cuts or (b, a) in self.cuts:
            return
        self.cluster.cut(f"meta{a}", "test" if b < 0 else f"meta{b}")  # type: ignore[attr-defined]
        self.cuts.add((a, b))
        self.count("cuts")

    async def op_cut(self, i: int, j: int) -> None:
        self._cut(i, j)

    async def op_cut_client(self, i: int) -> None:
        self._cut(i, -1)

    async def op_isolate(self, i: int) -> None:
        for j in self.members:
            if j != i:
                self._cut(i, j)

    async def op_isolate_leader(self) -> None:
        await self.to_leader("isolate")

    async def op_mend(self) -> None:
        if self.cuts:
            self.cluster.mend_all()  # type: ignore[attr-defined]
        self.cuts.clear()

    async def heal(self) -> None:
        await self.op_mend()
        for i, how in sorted(self.down.items()):
            if how == "stopped":
                self.cont_proc(i)
            else:
                self.cluster.start(i, timeout=60)
        self.down.clear()

    async def op_settle(self) -> None:
        """All replicas up; a barrier mutation acknowledged; every pending
        call's deadline past: each pending operation is now applied or never
        will be."""
        assert self.mc is not None
        await self.heal()
        end = time.monotonic() + 120
        n = 0
        while True:
            n += 1
            try:
                await self.mc.mkdir(f"{self.root}.barrier-{len(self.log)}-{n}")
                break
            except TierFSError as exc:
                if time.monotonic() > end:
                    self.violation("unavailable", f"no barrier write within 120 s of healing: {exc}")
                    return
        if self.pending:
            wait = max(pd.sent for pd in self.pending) + DEADLINE + SEAL_MARGIN - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # the condition is the deadlines: time itself
        for pd in list(self.pending):
            self.pending.remove(pd)
            obs = {q: await self.observe(q) for q in sorted(pd.paths)}
            if any(v is False for v in obs.values()):
                self.pending.append(pd)  # no answer: stays pending
                continue
            if all(self.same(obs[q], pd.after.get(q)) for q in pd.paths):
                self.resolve(pd, applied=True)
                for q in pd.paths:  # learn inode numbers
                    self.judge(q, obs[q])  # type: ignore[arg-type]
            elif all(self.same(obs[q], pd.before.get(q)) for q in pd.paths):
                self.resolve(pd, applied=False)
            else:
                self.violation("wrong-state", f"pending {pd.op} left {obs}: neither {pd.before} (not applied) "
                               f"nor {pd.after} (applied): half applied")

    async def finish(self) -> None:
        await self.op_settle()
        await self.op_check()
        # Everything acknowledged survives all replicas crashing at once.
        await self.op_crash_all()
        await self.op_settle()
        await self.op_check()
        try:
            await asyncio.to_thread(self.cluster.wait_converged, 60)
        except Exception as exc:
            self.violation("diverged", f"replica digests differ after the walk: {exc}")


# ---- the random walk -------------------------------------------------------------------


def meta_random_ops(seed: int, steps: int, ck: MetaChecker) -> Iterator[Op]:
    """Draw ``steps`` operations, each chosen from the walk's state (the
    model, pending operations, replicas down)."""
    rng = random.Random(seed)
    def members() -> list[int]:
        return list(ck.members) or [r.index for r in ck.cluster.replicas if r.alive]


    def dirs() -> list[str]:
        return sorted(q for q, s in ck.model.items() if s[0] == "dir")

    def fpath() -> str:
        """A name for a file: mostly in a directory that exists."""
        have = dirs()
        if rng.random() < 0.3:
            return rng.choice(NAMES)
        d = rng.choice(have) if have and rng.random() < 0.8 else rng.choice(DIRS)
        return f"{d}/{rng.choice(NAMES)}"

    def existing(kind: str | None = None) -> str | None:
        have = sorted(q for q, s in ck.model.items() if kind is None or (s[0] == "dir") == (kind == "dir"))
        return rng.choice(have) if have else None

    def anypath() -> str:
        q = existing() if rng.random() < 0.7 else None
        return q or (fpath() if rng.random() < 0.7 else rng.choice(DIRS))

    def file_op() -> Op:
        r = rng.random()
        p = (existing("file") if rng.random() < 0.8 else None) or fpath()
        if r < 0.35:
            return ("create", fpath(), rng.choice((0o644, 0o600, 0o640)))
        if r < 0.5:
            return ("symlink", fpath(), f"target-{rng.randrange(10**6)}")
        if r < 0.7:
            return ("unlink", p)
        st = ck.model.get(p)
        if st is not None and st[0] != "file":
            return ("stat", p)  # truncate and chmod: files only (a link's or a directory's rules aside)
        if r < 0.85:
            return ("write", p, rng.choice((0, 1, 70_000, 5 * 2**20 + 3, 20 * 2**20)))
        if r < 0.93:
            return ("truncate", p, rng.choice((0, 1, 4096, 10**6, 3 * 10**9)))
        return ("chmod", p, rng.choice((0o644, 0o600, 0o755)))

    def mkdir() -> Op:
        free = [d for d in DIRS if d not in ck.model]
        return ("mkdir", rng.choice(free) if free and rng.random() < 0.8 else rng.choice(DIRS))

    def rmdir() -> Op:
        d = existing("dir") if rng.random() < 0.8 else None
        return ("rmdir", d or rng.choice(DIRS))

    def rename() -> Op:
        src = (existing() if rng.random() < 0.85 else None) or anypath()
        st = ck.model.get(src)
        if st is not None and st[0] == "dir":
            dst = rng.choice(DIRS) if rng.random() < 0.8 else anypath()
        else:
            dst = fpath() if rng.random() < 0.6 else anypath()
        return ("rename", src, dst)

    def storm() -> Op:
        who: int | str = "leader" if rng.random() < 0.7 else rng.choice(members())
        return ("storm", [file_op() for _ in range(rng.randint(2, 6))], rng.choice(("kill", "stop")), who,
                rng.choice((0, 2, 5, 10, 30)))

    def fault() -> Op:
        up = [i for i in members() if i not in ck.down]
        if not ck.down:
            return rng.choices([("kill", rng.choice(up)), ("stop", rng.choice(up)), ("kill_leader",), storm(),
                                ("crash_all",), ("replace", rng.choice(up), rng.random() < 0.5)],
                               weights=[2, 2, 2, 3, 0.4, 0.5])[0]
        i = rng.choice(sorted(ck.down))
        back = ("cont" if ck.down[i] == "stopped" else "start", i)
        if len(ck.down) > 1:
            return back
        # A second replica down now and then: no quorum for a while.
        return rng.choices([back, ("kill", rng.choice(up)), ("stop", rng.choice(up))], weights=[6, 0.6, 0.6])[0]

    def partition() -> Op:
        if ck.cuts and rng.random() < 0.45:
            return ("mend",)
        up = [i for i in members() if i not in ck.down] or members()
        r = rng.random()
        if r < 0.35:
            return ("isolate_leader",)
        if r < 0.55 and len(up) >= 2:
            i, j = rng.sample(up, 2)
            return ("cut", i, j)
        if r < 0.8:
            return ("cut_client", rng.choice(up))
        return ("isolate", rng.choice(up))

    produced = 0
    while produced < steps:
        makers: list[tuple[float, Callable[[], Op]]] = [
            (12, file_op),
            (4, mkdir),
            (2, rmdir),
            (9, rename),
            (4, lambda: ("burst", [file_op() for _ in range(rng.randint(2, 5))])),
            (6, lambda: ("stat", anypath())),
            (3, lambda: ("list", rng.choice(("", *DIRS)))),
            (1, lambda: ("check",)),
            (1.5, lambda: ("snapshot", rng.choice(members()))),
            (4 if ck.pending else 0, lambda: ("settle",)),
            (9.4 if not ck.down else 7.2 if len(ck.down) == 1 else 30, fault),
            # Last, and weight 0 without partitions: the walks of a given seed
            # on a cluster without them stay what they were.
            ((6 if ck.cuts else 3) if ck.partitions else 0, partition),
        ]
        op = rng.choices([m for _, m in makers], weights=[w for w, _ in makers])[0]()
        if op[0] in ("burst", "storm"):
            # Independent operations: distinct paths, none a parent of another's.
            seen: set[str] = set()
            keep = []
            for o in op[1]:
                if (o[0] != "stat" and o[1] not in seen and parent_of(o[1]) not in seen
                        and not any(parent_of(q) == o[1] for q in seen) and not ck.touches_busy(o)):
                    seen.add(o[1])
                    keep.append(o)
            if len(keep) < 2:
                continue
            op = (op[0], keep, *op[2:])
        elif op[0] in ("mkdir", "rmdir", "create", "symlink", "unlink", "rename", "truncate", "chmod", "write") \
                and ck.touches_busy(op):
            continue
        produced += 1
        yield op
    if ck.pending:
        yield ("settle",)


#: Meta replicas for the walk: storage nodes (registered, never heard from
#: again) stay online for the walk's length, so that files can be created;
#: a snapshot every 60 entries, so that replicas that join or fall behind
#: catch up by snapshots, and restarts load them.
META_WALK_ARGS = ("--heartbeat-timeout=36000", "--snapshot-min-entries=60")


def meta_walk_cluster(path: Path, partitions: bool = False) -> MetaCluster:
    """Three meta replicas, and six registered storage nodes of one target
    each (no storage daemons: files are created, never written). With
    ``partitions``, each replica on a host of its own (tests/hosts.py's
    HostMetaCluster; skips where network namespaces are not allowed), so
    that walks can cut links."""
    if partitions:
        from tests.hosts import HostMetaCluster

        cluster: MetaCluster = HostMetaCluster(path, 3, state_machine="meta", extra_args=META_WALK_ARGS)
    else:
        cluster = MetaCluster(path, n=3, state_machine="meta", extra_args=META_WALK_ARGS)

    async def register() -> None:
        async with MetaClient(cluster.addresses, deadline=60) as mc:
            for i in range(6):
                await mc.register_node(f"meta-walk-node-{i}", f"node{i}", f"127.0.0.1:{9000 + i}",
                                       [(f"/data/t{i}", 1 << 40)])
            end = time.monotonic() + 60
            while True:  # groups are planned by the leader, shortly after
                try:
                    await mc.create("/meta-walk-ready")
                    return
                except AlreadyExistsError:
                    return
                except TierFSError:
                    if time.monotonic() > end:
                        raise
                    await asyncio.sleep(0.2)

    try:
        asyncio.run(register())
    except BaseException:
        cluster.close()
        raise
    return cluster


def run_meta_walk(cluster: MetaCluster, seed: int, steps: int, log_dir: Path | None = None) -> MetaChecker:
    ck = MetaChecker(cluster, f"/meta-walk-{seed}", seed=seed, log_dir=log_dir)
    asyncio.run(ck.run(meta_random_ops(seed, steps, ck)))
    return ck


def replay(log_file: Path) -> None:
    """Run a saved op log (``{"ops": [...]}``) on a fresh cluster."""
    import tempfile

    saved = json.loads(Path(log_file).read_text())
    ops = [tuple(op) for op in saved["ops"]]
    cuts = any(op[0] in ("cut", "cut_client", "isolate", "mend") for op in ops)
    with tempfile.TemporaryDirectory() as tmp, meta_walk_cluster(Path(tmp) / "meta", partitions=cuts) as cluster:
        ck = MetaChecker(cluster, saved["root"], seed=saved.get("seed"))
        asyncio.run(ck.run(ops))
        print(f"replayed {len(ops)} operations: no violation ({dict(sorted(ck.counts.items()))})")


if __name__ == "__main__":
    import sys

    replay(Path(sys.argv[1]))
