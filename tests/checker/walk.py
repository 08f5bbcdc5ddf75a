"""The model-based checker of the file data path: operations run against a
real cluster and the in-memory model (``tests.checker.model``) side by side,
every read compared byte for byte, storage faults interleaved, and every
scrub verdict compared with the truth on disk (``tests.checker.truth``).

An operation is a plain tuple (``("write", "h1", 70000, ("rand", 5, 1000))``)
so that a run is a list of them: :func:`random_ops` draws one from a seed
(each step chosen from the model's state), :meth:`Checker.run` replays any
list, and a failure prints the seed and the whole log (and writes it as
JSON, replayable with ``python -m tests.checker.replay FILE``; shrink it by
hand by deleting operations).

Operations (``h*``: handle ids; paths are under the checker's directory):

====================================  =========================================================
``("open", h, path, mode)``           modes r, r+, w, w+, a, a+, x, x+
``("write", h, off, data)``           ``off`` None: at the handle's position; data ("rand", seed,
                                      n) or ("fill", byte, n)
``("read", h, n)``                    ``n`` -1: to the end
``("seek", h, off)``, ``("flush", h)``, ``("close", h)``, ``("abort", h)``
``("write_file", path, data)``        ``write_bytes``
``("read_file", path)``               ``read_bytes``; ``("read_range", path, off, n)``: ``read_into``
``("truncate", path, size)``          ``Client.truncate``
``("rename", src, dst)``, ``("unlink", path)``
``("kill", node)``, ``("restart", node)``, ``("stop", node)``, ``("cont", node)``
``("kill_holder", path, chunk, j)``   SIGKILL the node holding fragment j of the chunk
``("corrupt", path, chunk, j)``       flip a payload byte of that fragment on disk
``("forge", path, chunk, j)``         rewrite that fragment through the data plane with other
                                      bytes: well formed, its own CRC32C valid, wrong
``("target_rm", node)``               ``tierfs target rm`` of the node's target, then wait for
                                      the rebuild
``("grow",)``                         one more storage daemon (``tierfs up --storage N+1``): the
                                      rebalancer moves group members onto it while the walk
                                      goes on, faults included (``random_ops(grow=)``)
``("scrub",)``                        heal, ``tierfs scrub``, verdict checked against the truth
``("settle",)``                       heal and wait for the cluster to be healthy
``("meta_kill", name)``               SIGKILL a meta replica (three of them: ``n_meta=3``);
                                      "leader" is logged as the replica it was
``("meta_restart", name)``            start it again
``("meta_crash_all",)``               SIGKILL every meta replica at once, start them all
====================================  =========================================================

With three meta replicas, :meth:`CheckerCluster.start_meta_nemesis` also
kills replicas (mostly the leader) from a thread at random moments, so
that failovers land in the middle of operations; those walks are not
replayable step for step (soak: ``TIERFS_CHECKER_META_NEMESIS=1``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.checker.model import MFile, MHandle, Model, apply_write, resized
from tests.checker.truth import Truth, chunk_table, gc_known, scan
from tests.checker.truth import _stored as _stored_len
from tierfs.cli.main import run as cli
from tierfs.cli.repair import scrub_cluster
from tierfs.client import Client, File
from tierfs.client.codec import codec_for
from tierfs.errors import (
    AlreadyExistsError,
    BusyError,
    InvalidArgumentError,
    NotFoundError,
    TierFSError,
)
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.storage.api import FragmentKey
from tierfs.storage.engine import crc32c as crc32c_of

__all__ = ["CheckFailed", "Checker", "CheckerCluster", "Op", "ProcessFaults", "data_of", "listing", "meta_fault", "own_failure", "random_ops", "save_log"]

Op = tuple[Any, ...]
log = logging.getLogger(__name__)
KiB = 1024

#: One meta replica (CPU is scarce); a node missing heartbeats for 1.5 s is
#: offline; targets are never replaced on their own (``target_rm`` does it);
#: former members delete their copies 1 s after they leave (group purges:
#: the walk reads through them, where the default 30 s would outlast it).
META_ARGS = ("--heartbeat-timeout=1.5", "--replace-after=0", "--tick-interval=0.2", "--purge-grace=1")
#: Fast heartbeats, GC and rebuild polls; no background scrub (the checker
#: scrubs and compares); orphans deletable at once (scrubs run only while no
#: writer is open, so no upload in flight can be taken for one).
STORAGE_ARGS = ("--heartbeat-interval=0.3", "--gc-interval=0.3", "--rebuild-interval=0.3", "--scrub-rate=0",
                "--orphan-grace=0")

#: Kinds of violation that leave the model out of step with the cluster: the
#: run stops there. The others are recorded and the run goes on.
FATAL = ("wrong-bytes", "unexpected-success", "unexpected-error", "api")


_HANDLE_OPS = ("write", "read", "seek", "flush", "close", "abort")


class CheckFailed(AssertionError):
    pass


def data_of(spec: Sequence[Any]) -> bytes:
    kind, a, n = spec
    if kind == "fill":
        return bytes([int(a)]) * int(n)
    if kind == "rep":
        return str(a).encode() * int(n)
    return bytes(np.random.default_rng(a).integers(0, 256, n, dtype=np.uint8).tobytes())


class CheckerCluster:
    """A real local cluster for the checker: 1 meta replica, ``n_storage``
    storage daemons, and the faults the checker injects (tracked, so that
    reads can be judged against what is really up)."""

    def __init__(self, path: Path, n_storage: int = 7, n_meta: int = 1) -> None:
        self.cl = LocalCluster(path, n_meta=n_meta, n_storage=n_storage, extra_meta_args=list(META_ARGS),
                               extra_storage_args=list(STORAGE_ARGS))
        self.down: dict[str, str] = {}  # storage-<i> -> "killed" | "stopped"
        self.meta_down: set[str] = set()  # meta-<i> SIGKILLed (with n_meta 3)
        self.removed: set[int] = set()  # target ids removed with `target rm`
        #: storage-<i> restarted with a reserve that leaves its target full
        #: (read-only), -> its argv before (:meth:`squeeze`)
        self.squeezed: dict[str, list[str]] = {}
        #: The meta nemesis (:meth:`start_meta_nemesis`): every change of the
        #: meta replicas' processes holds this lock; it acts only while
        #: ``_nemesis_pauses`` is 0.
        self._meta_lock = threading.RLock()
        self._nemesis_pauses = 0
        self._nemesis: threading.Thread | None = None
        self._nemesis_stop = threading.Event()
        #: What the nemesis did: (monotonic time, "kill meta-1" / "start meta-1").
        self.nemesis_log: list[tuple[float, str]] = []
        self.cl.up(timeout=180)

    @property
    def meta(self) -> list[str]:
        return self.cl.meta_addrs

    def storage(self) -> list[str]:
        return [p.name for p in self.cl.procs if p.kind == "storage"]

    def client(self, **kw: Any) -> Client:
        # Short timeouts (a stopped node costs seconds, not tens of them), but
        # not so short that a loaded machine times healthy nodes out.
        return Client(self.meta, request_timeout=2.0, connect_timeout=1.0, retries=2, meta_deadline=30.0, **kw)

    def kill(self, name: str) -> None:
        if self.down.get(name) == "stopped":
            os.kill(self.cl.proc(name).pid, signal.SIGCONT)
        self.cl.kill(name)
        self.down[name] = "killed"

    def stop(self, name: str) -> None:
        self.cl.kill(name, signal.SIGSTOP)
        self.down[name] = "stopped"

    def cont(self, name: str) -> None:
        os.kill(self.cl.proc(name).pid, signal.SIGCONT)
        self.down.pop(name, None)

    def restart(self, name: str) -> None:
        self.cl.start(names=[name], timeout=60)
        self.down.pop(name, None)
        self.wait_online([name])

    def squeeze(self, name: str) -> None:
        """Restart ``name`` with a reserve that leaves its target 128 KiB
        short of the file system's free space: full (read-only) from its
        first heartbeat on, and fuller as the others write. Writes go
        around it, placement and moves stop choosing it, and a move in
        flight onto it is sent on to another target by the leader."""
        p = self.cl.proc(name)
        self.cl.kill(name)
        self.squeezed[name] = list(p.argv)
        st = os.statvfs(self.cl.dir)
        reserve = max(0, st.f_bavail * st.f_frsize - 128 * KiB)
        p.argv = [*p.argv, f"--reserved-bytes={reserve}"]
        self.cl.start(names=[name], timeout=60)
        self.wait_online([name])

    def unsqueeze(self, name: str) -> None:
        p = self.cl.proc(name)
        self.cl.kill(name)
        p.argv = self.squeezed.pop(name)
        self.cl.start(names=[name], timeout=60)
        self.wait_online([name])

    def metas(self) -> list[str]:
        return [p.name for p in self.cl.procs if p.kind == "meta"]

    def meta_leader(self) -> str | None:
        """The meta replica that says it leads."""
        async def ask() -> str | None:
            async with MetaClient(self.meta, deadline=10) as mc:
                for p in self.cl.procs:
                    if p.kind == "meta" and p.name not in self.meta_down:
                        with contextlib.suppress(TierFSError):
                            if (await mc.status(p.addr)).role == "leader":
                                return p.name
            return None
        return asyncio.run(ask())

    def meta_kill(self, name: str) -> None:
        """SIGKILL meta replica ``name``; one already down (the meta nemesis
        may have got there between the op's draw and its run) stays down."""
        with self._meta_lock:
            if name in self.meta_down:
                return
            self.cl.kill(name)
            self.meta_down.add(name)

    def meta_restart(self, name: str) -> None:
        """Start meta replica ``name`` again; one running (started again by
        the nemesis meanwhile) is left as it is."""
        with self._meta_lock:
            if name not in self.meta_down:
                return
            self.cl.start(names=[name], timeout=60)
            self.meta_down.discard(name)

    # ---- the meta nemesis: leaders killed in the middle of operations --------------

    def start_meta_nemesis(self, seed: int, mean_gap: float = 2.5) -> None:
        """Kill meta replicas at random moments, from a thread, while the walk
        runs: the leader 7 times in 10, started again 0.3-2 s later (with
        one the walk killed, that leaves no quorum meanwhile). Unlike the walk's ``meta_kill`` op (between
        operations) these land in the middle of calls: a commit, a lease
        renewal, a batch. Every operation must still succeed or fail as the
        model says (the client retries through the failover with the same
        request ids). Not replayable step for step: the timing is the
        thread's. Paused (:meth:`nemesis_paused`) for heal, scrub and the
        final checks."""
        if len(self.metas()) < 3:
            raise ValueError("the meta nemesis needs three meta replicas (n_meta=3)")
        rng = random.Random(seed)

        def run() -> None:
            while not self._nemesis_stop.wait(rng.uniform(0.3, 2 * mean_gap)):
                with self._meta_lock:
                    running = [m for m in self.metas() if m not in self.meta_down]
                    if self._nemesis_pauses or not running:
                        continue
                    try:
                        victim = (self.meta_leader() if rng.random() < 0.7 else None) or rng.choice(running)
                    except Exception:  # no leader to ask right now: any replica
                        victim = rng.choice(running)
                    self.cl.kill(victim)
                    self.meta_down.add(victim)
                    self.nemesis_log.append((time.monotonic(), f"kill {victim}"))
                self._nemesis_stop.wait(rng.uniform(0.3, 2.0))
                with self._meta_lock:
                    if victim in self.meta_down:
                        try:
                            self.cl.start(names=[victim], timeout=60)
                        except TierFSError as exc:
                            # Left down: the walk's next meta_restart or heal
                            # starts it, and fails the walk if it cannot.
                            self.nemesis_log.append((time.monotonic(), f"start {victim} failed: {exc}"))
                            log.warning("meta nemesis: starting %s failed (left down for the walk): %s", victim, exc)
                            continue
                        self.meta_down.discard(victim)
                        self.nemesis_log.append((time.monotonic(), f"start {victim}"))

        self._nemesis_stop.clear()
        self._nemesis = threading.Thread(target=run, name="meta-nemesis", daemon=True)
        self._nemesis.start()

    def stop_meta_nemesis(self) -> None:
        if self._nemesis is not None:
            self._nemesis_stop.set()
            self._nemesis.join(120)
            self._nemesis = None

    @contextlib.contextmanager
    def nemesis_paused(self) -> Iterator[None]:
        """No nemesis kill from here to the end of the block (one in
        progress finishes first: its replica is started again by heal)."""
        with self._meta_lock:
            self._nemesis_pauses += 1
        try:
            yield
        finally:
            with self._meta_lock:
                self._nemesis_pauses -= 1

    def heal(self) -> None:
        with self._meta_lock:
            for name in sorted(self.meta_down):
                self.meta_restart(name)
        for name, how in sorted(self.down.items()):
            if how == "stopped":
                self.cont(name)
        killed = [n for n, how in self.down.items() if how == "killed"]
        if killed:
            self.cl.start(names=killed, timeout=60)
        self.down.clear()
        for name in sorted(self.squeezed):
            self.unsqueeze(name)
        self.wait_online(self.storage())

    def wait_online(self, names: Sequence[str], timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                h = asyncio.run(self.cl.health(deadline=5.0))
                last = {s["name"]: s["state"] for s in h["storage"]}
                if all(last.get(n) == "online" for n in names):
                    return
            except Exception as exc:  # a meta still electing may fail in any way: keep asking
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.1)
        raise AssertionError(f"storage nodes {list(names)} not online after {timeout:.0f}s: {last}")

    def cmap(self) -> pb.ClusterMap:
        async def get() -> pb.ClusterMap:
            async with MetaClient(self.meta, deadline=20) as mc:
                return await mc.get_cluster_map()
        return asyncio.run(get())

    def wait_rebuilt(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not any(g.rebuilding for g in self.cmap().groups):
                return True
            time.sleep(0.2)
        return False

    def grow(self, timeout: float = 90.0) -> str:
        """Add one storage daemon, as ``tierfs up --storage N+1`` does on a
        running cluster, and wait until meta calls it online. The leader's
        rebalancer then moves group members onto it in the background."""
        new = self.cl.grow(len(self.storage()) + 1)
        self.cl.start(names=new, timeout=timeout)
        self.wait_online(new, timeout=timeout)
        return new[0]

    def rebalance(self) -> pb.RebalanceStatus:
        async def get() -> pb.RebalanceStatus:
            async with MetaClient(self.meta, deadline=20) as mc:
                return await mc.rebalance_status()
        return asyncio.run(get())

    def node_of_target(self, tid: int) -> str:
        cmap = self.cmap()
        node = next(t.node_id for t in cmap.targets if t.target_id == tid)
        addr = next(n.data_addr for n in cmap.nodes if n.node_id == node)
        return next(p.name for p in self.cl.procs if p.addr == addr)

    def target_of_node(self, name: str) -> int:
        addr = self.cl.proc(name).addr
        cmap = self.cmap()
        node = next(n for n in cmap.nodes if n.data_addr == addr)
        return int(node.target_ids[0])

    def close(self) -> None:
        self.stop_meta_nemesis()
        for name, how in list(self.down.items()):
            if how == "stopped":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.cl.proc(name).pid, signal.SIGCONT)
        self.cl.stop()


class ProcessFaults:
    """The process faults both checkers draw (this one and the KV checker,
    tests/checker/kv_walk.py), on their ``env``."""

    env: CheckerCluster
    log: list[Op]

    def op_kill(self, node: str) -> None:
        self.env.kill(node)

    def op_stop(self, node: str) -> None:
        self.env.stop(node)

    def op_cont(self, node: str) -> None:
        self.env.cont(node)

    def op_restart(self, node: str) -> None:
        self.env.restart(node)

    def op_meta_kill(self, name: str) -> None:
        """SIGKILL meta replica ``name`` (or the leader: "leader", logged as
        the replica it was); the walk's calls go on through the failover."""
        if name == "leader":
            name = self.env.meta_leader() or "meta-0"
            self.log[-1] = ("meta_kill", name)
        self.env.meta_kill(name)

    def op_meta_restart(self, name: str) -> None:
        self.env.meta_restart(name)

    def op_meta_crash_all(self) -> None:
        """SIGKILL every meta replica at once, then start them all: what
        they acknowledged must all be there."""
        with self.env._meta_lock:
            for name in self.env.metas():
                if name not in self.env.meta_down:
                    self.env.meta_kill(name)
            self.env.cl.start(names=self.env.metas(), timeout=60)
            self.env.meta_down.clear()


#: Operations the meta nemesis stays out of: they heal the cluster and judge
#: it against the truth on disk (CheckerCluster.start_meta_nemesis).
_QUIET_OPS = frozenset({"settle", "scrub", "target_rm"})


@dataclass
class Checker(ProcessFaults):
    env: CheckerCluster
    client: Client
    root: str  # the directory the checker's files live in
    seed: int | None = None
    log: list[Op] = field(default_factory=list)
    model: Model = field(default_factory=Model)
    real: dict[str, File] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    scrubs: list[dict[str, Any]] = field(default_factory=list)
    #: (inode, chunk, position, generation) -> CRC32C of the bytes ``op_forge`` wrote there.
    forged: dict[tuple[int, int, int, int], int] = field(default_factory=dict)
    log_dir: Path | None = None
    old_clients: list[Client] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # time spent per kind of operation
    grown: list[str] = field(default_factory=list)  # storage daemons op_grow added

    # ---- running ------------------------------------------------------------------

    def run(self, ops: Iterator[Op] | Sequence[Op], *, finish: bool = True) -> None:
        """Apply ``ops`` in order (a generator may look at the model between
        steps); with ``finish``, close every handle, heal, verify every file
        and require a clean scrub and a clean truth at the end."""
        try:
            for op in ops:
                self.log.append(op)
                self.step(op)
            if finish:
                self.finish()
        except CheckFailed:
            raise
        except Exception as exc:
            self.violation("unexpected-error", own_failure(exc, len(self.log)))
        finally:
            if finish:
                self.close()
        if self.violations:
            raise CheckFailed(self.report())

    def step(self, op: Op) -> None:
        if op[0] in _HANDLE_OPS and op[1] not in self.model.handles:
            # Its open failed as the model expected (busy, missing): nothing to do.
            self.counts["skipped"] = self.counts.get("skipped", 0) + 1
            return
        self.counts[op[0]] = self.counts.get(op[0], 0) + 1
        t0 = time.monotonic()
        try:
            with self.env.nemesis_paused() if op[0] in _QUIET_OPS else contextlib.nullcontext():
                getattr(self, "op_" + op[0])(*op[1:])
        finally:
            self.seconds[op[0]] = self.seconds.get(op[0], 0.0) + time.monotonic() - t0

    def violation(self, kind: str, msg: str) -> None:
        self.violations.append(f"[{kind}] step {len(self.log)} {self.log[-1] if self.log else ''}: {msg}")
        self.counts["violation:" + kind] = self.counts.get("violation:" + kind, 0) + 1
        if kind in FATAL:
            raise CheckFailed(self.report())

    def report(self) -> str:
        path = save_log(self.log_dir, f"checker-{self.root.strip('/').replace('/', '_')}-seed{self.seed}.json",
                        self.root, self.seed, self.log, self.violations)
        return (f"model-based checker: {len(self.violations)} violation(s) in {self.root} (seed {self.seed}, "
                f"{len(self.log)} steps)\n" + "\n".join(self.violations)
                + f"\ncounts: {dict(sorted(self.counts.items()))}"
                + f"\nop log{f' (saved to {path}; replay: python -m tests.checker.replay {path})' if path else ''}:\n"
                + listing(self.log))

    def p(self, path: str) -> str:
        return f"{self.root}/{path}" if not path.startswith("/") else path

    @property
    def faulty(self) -> bool:
        return bool(self.env.down)

    # ---- reads: judged byte for byte, failures judged against the truth --------------

    def _check_read(self, what: str, got: bytes, cands: Sequence[bytes], cut: Callable[[bytes], bytes]) -> list[bytes]:
        ok = [c for c in cands if cut(c) == got]
        if not ok:
            exp = ", ".join(_describe(cut(c)) for c in cands[:3])
            self.violation("wrong-bytes", f"{what} returned {_describe(got)}; the model allows {exp}"
                           + _first_diff(got, cut(cands[0])))
        return ok

    def _excuse(self, what: str, path: str | None, exc: TierFSError, inode: int | None = None,
                gens: dict[int, int] | None = None) -> None:
        """A read failed: fine only if some chunk of the file really has too
        few valid fragments of its committed generation on live nodes.
        ``gens``: the generations a handle opened before a rewrite reads
        (chunk -> generation); the truth is about the committed ones only,
        so a failed read of an older generation is not judged (counted
        ``read_failed_unjudged``)."""
        self.counts["read_failed"] = self.counts.get("read_failed", 0) + 1
        try:
            if inode is None:
                assert path is not None
                inode = self.client.stat(path).inode
            truth = self._truth()
        except TierFSError:
            return
        recs = truth.records.get(inode)
        if recs is None:
            return
        # A handle that reads generations no longer committed (a rewrite,
        # or a truncate that dropped the chunk since it opened: seed 17028,
        # a reader of a file truncated to 0 was judged against no records
        # and called an availability violation) is not judged.
        if gens is not None and any(i not in recs or g != recs[i].generation for i, g in gens.items()):
            self.counts["read_failed_unjudged"] = self.counts.get("read_failed_unjudged", 0) + 1
            return
        codec, _cs = truth.widths[inode]
        need = 1 if codec.replicated else codec.k
        short, stale_missing = [], []
        for idx, rec in sorted(recs.items()):
            live = {j: n for j, n in self._good(truth, inode, idx).items() if n not in self.env.down}
            if len(live) < need:
                short.append(idx)
            elif len(set(live) - set(rec.missing)) < need:
                stale_missing.append((idx, sorted(rec.missing), sorted(live)))
        if short:
            self.counts["read_failed_excused"] = self.counts.get("read_failed_excused", 0) + 1
            return
        extra = (f"; meta's records list as missing positions the disk holds valid (chunk, missing, valid "
                 f"on live nodes): {stale_missing[:4]}" if stale_missing else "")
        self.violation("availability", f"{what} failed ({type(exc).__name__}: {exc}) although every chunk has "
                       f"{need}+ valid fragments of its committed generation on live nodes (down: "
                       f"{dict(self.env.down)}){extra}")

    def _good(self, truth: Truth, inode: int, idx: int) -> dict[int, str]:
        """The chunk's valid positions (and their nodes), less those that
        still hold bytes this walk forged (``op_forge``)."""
        rec = truth.records.get(inode, {}).get(idx)
        gen = rec.generation if rec is not None else -1
        return {j: n for j, n in truth.valid.get((inode, idx), {}).items()
                if self.forged.get((inode, idx, j, gen)) != truth.payload_crc.get((inode, idx, j))}

    def _truth(self, gc_before: set[Any] | None = None) -> Truth:
        sessions = {}
        inodes = []
        for hid, h in self.model.handles.items():
            f = self.real[hid]._f
            if h.writable and f._session is not None:
                sessions[f.inode] = int(f._session.data_version)
        for path in self.model.files:
            with contextlib.suppress(TierFSError):
                inodes.append(self.client.stat(self.p(path)).inode)
        return scan(self.env.meta, self.env.cl.dir, inodes, sessions, self.env.removed, gc_before)

    # ---- namespace and whole-file operations --------------------------------------------

    def _expect_error(self, what: str, want: type[TierFSError], fn: Callable[[], Any]) -> bool:
        """Run ``fn`` expecting ``want``; False (and a violation) otherwise."""
        try:
            fn()
        except want:
            return True
        except TierFSError as exc:
            self.violation("api", f"{what}: expected {want.__name__}, got {type(exc).__name__}: {exc}")
            return False
        self.violation("unexpected-success", f"{what} succeeded; expected {want.__name__}")
        return False

    def op_write_file(self, path: str, spec: Sequence[Any]) -> None:
        data = data_of(spec)
        f = self.model.files.get(path)
        if f is not None and f.writer is not None:
            self._expect_error(f"write_bytes({path}) while it is open for writing", BusyError,
                               lambda: self.client.write_bytes(self.p(path), data))
            return
        try:
            self.client.write_bytes(self.p(path), data)
        except TierFSError as exc:
            self._write_failed(f"write_bytes({path}, {len(data)} bytes)", exc)
            # "wb" replaces at its commit (stop 45): what is left is the old
            # contents, or the new ones where the commit was applied but its
            # answer lost. A file the write created is removed again (stop
            # 46), or stays, empty, where meta could not be reached.
            if f is None:
                if self.client.exists(self.p(path)):
                    self.model.new_file(path).commit([b"", data])
            else:
                f.commit([*f.cands, data])
            return
        if f is None:
            f = self.model.new_file(path)
        f.commit([data])

    def _write_failed(self, what: str, exc: TierFSError) -> None:
        self.counts["write_failed"] = self.counts.get("write_failed", 0) + 1
        if not self.faulty:
            # Not a violation on its own (a node just back may still be
            # marked down in the client for a moment), but worth a count.
            self.counts["write_failed_no_fault"] = self.counts.get("write_failed_no_fault", 0) + 1

    def op_read_file(self, path: str) -> None:
        f = self.model.files.get(path)
        if f is None:
            self._expect_error(f"read_bytes({path}) of a missing file", NotFoundError,
                               lambda: self.client.read_bytes(self.p(path)))
            return
        try:
            got = self.client.read_bytes(self.p(path))
        except TierFSError as exc:
            self._excuse(f"read_bytes({path})", self.p(path), exc)
            return
        f.cands = self._check_read(f"read_bytes({path})", got, f.cands, lambda c: c)

    def op_read_range(self, path: str, off: int, n: int) -> None:
        f = self.model.files.get(path)
        if f is None:
            return
        buf = bytearray(n)
        try:
            got_n = self.client.read_into(self.p(path), buf, off)
        except TierFSError as exc:
            self._excuse(f"read_into({path}, {n} bytes at {off})", self.p(path), exc)
            return
        f.cands = self._check_read(f"read_into({path}, {n} bytes at {off})", bytes(buf[:got_n]), f.cands,
                                   lambda c: c[off: off + n])

    def op_truncate(self, path: str, size: int) -> None:
        f = self.model.files.get(path)
        if f is None:
            self._expect_error(f"truncate({path}) of a missing file", NotFoundError,
                               lambda: self.client.truncate(self.p(path), size))
            return
        if f.writer is not None:
            self._expect_error(f"truncate({path}) while it is open for writing", BusyError,
                               lambda: self.client.truncate(self.p(path), size))
            return
        self.client.truncate(self.p(path), size)
        f.commit([resized(c, size) for c in f.cands])

    def op_rename(self, src: str, dst: str) -> None:
        if src not in self.model.files:
            self._expect_error(f"rename({src}) of a missing file", NotFoundError,
                               lambda: self.client.rename(self.p(src), self.p(dst)))
            return
        self.client.rename(self.p(src), self.p(dst))
        self.model.rename(src, dst)

    def op_unlink(self, path: str) -> None:
        if path not in self.model.files:
            self._expect_error(f"rm({path}) of a missing file", NotFoundError, lambda: self.client.rm(self.p(path)))
            return
        self.client.rm(self.p(path))
        self.model.unlink(path)

    # ---- handles -----------------------------------------------------------------------

    def op_open(self, hid: str, path: str, mode: str) -> None:
        base, plus = mode[0], "+" in mode
        f = self.model.files.get(path)
        writable = base != "r" or plus
        what = f"open({path}, {mode!r})"
        if base == "r" and f is None:
            self._expect_error(what + " of a missing file", NotFoundError, lambda: self.client.open(self.p(path), mode))
            return
        if base == "x" and f is not None:
            self._expect_error(what + " of an existing file", AlreadyExistsError,
                               lambda: self.client.open(self.p(path), mode))
            return
        if writable and f is not None and f.writer is not None:
            self._expect_error(what + " while another writer has it", BusyError,
                               lambda: self.client.open(self.p(path), mode))
            return
        try:
            real = self.client.open(self.p(path), mode)
        except TierFSError as exc:
            if not self.faulty:
                raise
            # Meta may refuse to place a new file while too few nodes are up
            # (or a later step of the open failed): nothing half-done may stay.
            self.counts["open_failed"] = self.counts.get("open_failed", 0) + 1
            self.counts["open_failed:" + type(exc).__name__] = self.counts.get("open_failed:" + type(exc).__name__, 0) + 1
            if f is None and self.client.exists(self.p(path)):
                self.model.new_file(path)  # created, then the write session refused: an empty file
            return  # (a "w" open of an existing file changes nothing until its close)
        created = f is None
        if f is None:
            f = self.model.new_file(path)
        # A reader may read any version from the oldest the file may hold
        # now on: the last commit of each candidate (a read may have pruned
        # the candidates to one that is not among the newest versions, as
        # after a failed write whose new contents a read ruled out; until
        # stop 46 this took the newest len(cands) versions, and a reader
        # opened then was judged against the ruled-out contents).
        first = min((max(i for i, v in enumerate(f.versions) if v == c) for c in f.cands),
                    default=len(f.versions))
        size = real.size
        if base == "w":
            # Written anew: the handle starts empty, while every reader sees
            # the old contents until its close replaces them (an abort keeps
            # them). Until stop 45 "w" truncated at open.
            if size != 0:
                self.violation("wrong-bytes", f"{what}: size {size}, a 'w' handle starts empty")
            cands = [b""]
        else:
            cands = [c for c in f.cands if len(c) == size]
            if not cands:
                self.violation("wrong-bytes", f"{what}: size {size}, the model allows sizes "
                                              f"{[len(c) for c in f.cands]}")
            f.cands = cands
        h = MHandle(hid, f, mode, readable=base == "r" or plus, writable=writable, append=base == "a",
                    pos=size if base == "a" else 0)
        if writable:
            h.cands = list(cands)
            h.base = list(f.cands)
            h.created = created
            f.writer = h
        else:
            h.open_size = size
            h.first_version = first
        self.model.handles[hid] = h
        self.real[hid] = real

    def _h(self, hid: str) -> tuple[MHandle, File]:
        return self.model.handles[hid], self.real[hid]

    def _poisoned(self, h: MHandle, real: File, what: str, exc: TierFSError) -> None:
        """A writer's call failed: if the session is aborted (the error is
        latched), nothing of it may become visible; if not (a read of the
        chunk's old bytes failed), the write may be partly applied."""
        if real._f._error is not None:
            h.failed = h.failed or f"{what}: {type(exc).__name__}: {exc}"
        else:
            h.failed = h.failed or f"partial: {what}: {type(exc).__name__}: {exc}"

    def op_write(self, hid: str, off: int | None, spec: Sequence[Any]) -> None:
        h, real = self._h(hid)
        data = data_of(spec)
        if off is not None:
            real.seek(off)
            h.pos = off
        start = h.pos
        if not h.writable:
            self._expect_error(f"write to read-only handle {hid}", InvalidArgumentError, lambda: real.write(data))
            return
        try:
            real.write(data)
        except TierFSError as exc:
            self._write_failed(f"write {hid}", exc)
            self._poisoned(h, real, f"write of {len(data)} bytes at {h.pos}", exc)
            return
        new = []
        for c in h.cands:
            pos = len(c) if h.append else h.pos
            new.append(apply_write(c, pos, data))
        h.cands = new
        h.pos = real.tell()
        if not h.append and h.pos != start + len(data):
            self.violation("api", f"{hid}: position {h.pos} after writing {len(data)} bytes at {start}")

    def op_seek(self, hid: str, off: int) -> None:
        h, real = self._h(hid)
        real.seek(off)
        h.pos = off

    def op_read(self, hid: str, n: int) -> None:
        h, real = self._h(hid)
        if not h.readable:
            self._expect_error(f"read from write-only handle {hid}", InvalidArgumentError, lambda: real.read(n))
            return
        pos = h.pos
        try:
            got = real.read(n)
        except TierFSError as exc:
            if h.writable:
                # The flush before the read latches the session's error if
                # it failed; a read that failed after it changed nothing, so
                # the session may still publish what was written (seed 9328).
                if real._f._error is not None:
                    self._poisoned(h, real, "read (flush first)", exc)
                if real._f._error is None and not self.faulty:
                    self.violation("availability", f"{hid} ({h.mode}).read({n}) at {pos} failed with every "
                                   f"node up: {type(exc).__name__}: {exc}")
                return
            if not h.file.linked:
                return  # the file is gone: a clean error is all it can give
            v = real._f._view  # the generations this handle reads (it may predate a rewrite)
            gens = {i: r.generation for i in range(-(-v.size // v.chunk_size)) if (r := v.record(i)) is not None}
            self._excuse(f"{hid}.read({n}) at {pos}", None, exc, real._f.inode, gens)
            return
        if h.writable:
            def cut(c: bytes) -> bytes:
                k = max(0, min(n if n >= 0 else len(c), len(c) - pos))
                return c[pos: pos + k]
            h.cands = self._check_read(f"{hid} ({h.mode}).read({n}) at {pos} (own writes)", got, h.cands, cut)
        else:
            vs = h.file.versions[h.first_version:]
            want = max(0, min(n if n >= 0 else h.open_size, h.open_size - pos))

            def cut(c: bytes) -> bytes:
                return c[pos: pos + want]
            self._check_read(f"{hid} (r, opened at size {h.open_size}).read({n}) at {pos}", got, vs, cut)
        h.pos = pos + len(got)

    def op_flush(self, hid: str) -> None:
        h, real = self._h(hid)
        try:
            real.flush()
        except TierFSError as exc:
            self._poisoned(h, real, "flush", exc)

    def op_abort(self, hid: str) -> None:
        h, real = self._h(hid)
        real.abort()
        self._drop(h)
        self._created_gone(h)

    def _created_gone(self, h: MHandle) -> None:
        """A writer whose open created its file ended without a commit: the
        client removes the file again (stop 46) when it is still that inode
        and empty with no writer; it stays, empty, when meta could not be
        reached. Which happened is read from the cluster; a removal of a
        file the model says holds bytes is data lost."""
        f = h.file
        if not h.created or not f.linked:
            return
        path = _path_of(self.model, f)
        if self.client.exists(self.p(path)):
            return
        if b"" not in f.cands:
            self.violation("lost", f"{h.hid}: the file {path} it created was removed at its end, but it holds "
                                   f"{sorted({len(c) for c in f.cands})} bytes committed")
        self.model.unlink(path)
        self.counts["created_removed"] = self.counts.get("created_removed", 0) + 1

    def _drop(self, h: MHandle) -> None:
        del self.model.handles[h.hid]
        del self.real[h.hid]
        if h.file.writer is h:
            h.file.writer = None

    def op_close(self, hid: str) -> None:
        h, real = self._h(hid)
        f = h.file
        if not h.writable:
            real.close()
            self._drop(h)
            return
        flushed = False
        if not h.failed:
            try:
                real.flush()
                flushed = True
            except TierFSError as exc:
                self._poisoned(h, real, "flush at close", exc)
        try:
            real.close()
        except TierFSError:
            self._drop(h)
            if not f.linked:
                return  # unlinked meanwhile: its session is gone
            if flushed:
                # The commit itself failed: it may have been applied or not.
                f.commit([*f.cands, *h.cands])
                self.counts["commit_ambiguous"] = self.counts.get("commit_ambiguous", 0) + 1
            self._created_gone(h)
            return
        self._drop(h)
        if not f.linked:
            self.violation("api", f"close of {hid} succeeded although its file was unlinked (its session is gone)")
            return
        if h.failed.startswith("partial:"):
            # The write raised but the session went on: what it published is
            # unknowable here. The docs say any failure aborts the session.
            self.violation("doc", f"{hid}: a call failed ({h.failed}) but close() published the session")
            got = self.client.read_bytes(self.p(_path_of(self.model, f)))
            f.commit([got])
            return
        if h.failed:
            self.violation("unexpected-success", f"{hid}: close() published a session whose call failed ({h.failed})")
        if real.size not in [len(c) for c in h.cands]:
            self.violation("api", f"{hid}: closed at size {real.size}, the model says {[len(c) for c in h.cands]}")
        f.commit(h.cands)

    # ---- faults (kill, stop, cont, restart: ProcessFaults) -------------------------------

    def op_settle(self) -> None:
        self.env.heal()

    def op_fresh_client(self) -> None:
        """Go on with a new client: one that has not seen the faults (no
        target marked failed, no cached map), like another process. Open
        handles keep the client they were opened with."""
        self.old_clients.append(self.client)
        self.client = self.env.client()

    def close(self) -> None:
        for c in [*self.old_clients, self.client]:
            # Partial reads whose STATs could not all be had (read whole
            # instead): reported, so that a soak shows how often that happens.
            self.counts["whole_chunk_rereads"] = (self.counts.get("whole_chunk_rereads", 0)
                                                  + c.aclient.whole_chunk_rereads)
            with contextlib.suppress(Exception):
                c.close()

    def _holder(self, path: str, chunk: int, j: int) -> tuple[int, str, int]:
        """(target, node, inode) holding fragment ``j`` (modulo the width) of the chunk."""
        info = asyncio.run(_stat(self.env.meta, self.p(path)))
        lay = info.layout
        gid = lay.groups[chunk % len(lay.groups)]
        cmap = self.env.cmap()
        members = next(g for g in cmap.groups if g.group_id == gid).target_ids
        tid = int(members[j % len(members)])
        return tid, self.env.node_of_target(tid), info.attr.inode

    def _fragment_file(self, path: str, chunk: int, j: int) -> Path | None:
        _tid, node, ino = self._holder(path, chunk, j)
        rec = chunk_table(asyncio.run(_stat(self.env.meta, self.p(path)))).get(chunk)
        if rec is None:
            return None
        width = codec_for(asyncio.run(_stat(self.env.meta, self.p(path))).layout).width
        root = next(p.parent for p in self.env.cl.dir.glob(f"{node}/t*/target.json"))
        return root / "frags" / f"{ino & 0xFF:02x}" / f"{ino:016x}" / f"{chunk:x}.{j % width:x}.{rec.generation:x}"

    def op_delete_frag(self, path: str, chunk: int, j: int) -> None:
        fp = self._fragment_file(path, chunk, j)
        if fp is not None:
            with contextlib.suppress(FileNotFoundError):
                fp.unlink()
                self.counts["deleted_fragments"] = self.counts.get("deleted_fragments", 0) + 1

    def op_kill_holder(self, path: str, chunk: int, j: int) -> None:
        if path not in self.model.files:
            return
        _, node, _ = self._holder(path, chunk, j)
        if self.env.down.get(node) != "killed":
            self.env.kill(node)

    def op_corrupt(self, path: str, chunk: int, j: int) -> None:
        fp = self._fragment_file(path, chunk, j)
        if fp is None:
            return
        # Never the last fragments the chunk can be rebuilt from: with fewer
        # than K valid (one copy for replicas) left, no system could repair
        # it, and the run's end (every file read, the scrub converging)
        # would judge the injected damage instead of TierFS (seen: seed
        # 9303, two copies corrupted of a chunk whose third was never
        # written: its node was stopped during the degraded write).
        with contextlib.suppress(TierFSError, KeyError):
            _, _, ino = self._holder(path, chunk, j)
            truth = self._truth()
            codec, _cs = truth.widths[ino]
            need = 1 if codec.replicated else codec.k
            valid = set(self._good(truth, ino, chunk)) - {j % codec.width}
            if len(valid) < need:
                self.counts["corrupt_skipped"] = self.counts.get("corrupt_skipped", 0) + 1
                return
        with contextlib.suppress(FileNotFoundError), open(fp, "r+b") as fh:
            raw = fh.read()
            hdr_len = int.from_bytes(raw[12:16], "little")
            size = int.from_bytes(raw[48:56], "little")
            if size:
                at = hdr_len + (chunk * 7919 + j) % size
                fh.seek(at)
                fh.write(bytes([raw[at] ^ 0x5A]))
                self.counts["corrupted"] = self.counts.get("corrupted", 0) + 1

    def op_forge(self, path: str, chunk: int, j: int) -> None:
        """Rewrite fragment ``j`` of the chunk through the data plane (a node
        capability, as a daemon holds) with other bytes of its stored length:
        a well-formed fragment whose own CRC32C holds but which disagrees with
        the rest of its chunk, as a misdirected or buggy write would leave it.
        No per-fragment check can see it: reads must decode around it (never
        return it), the whole-chunk scrub must find it, a repair must not
        build from it. Never the last good fragments, as for ``corrupt``."""
        if path not in self.model.files:
            return
        try:
            tid, node, ino = self._holder(path, chunk, j)
            truth = self._truth()
        except TierFSError:
            return
        rec = truth.records.get(ino, {}).get(chunk)
        if rec is None or rec.length is None or ino not in truth.widths or node in self.env.down:
            return
        codec, cs = truth.widths[ino]
        pos = j % codec.width
        size = _stored_len(codec, cs, rec.length, pos)
        need = 1 if codec.replicated else codec.k
        if not size or len(set(self._good(truth, ino, chunk)) - {pos}) < need:
            self.counts["forge_skipped"] = self.counts.get("forge_skipped", 0) + 1
            return
        seed = crc32c_of(f"{ino}:{chunk}:{pos}:{rec.generation}".encode())
        payload = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
        crc = crc32c_of(payload)
        if crc == truth.payload_crc.get((ino, chunk, pos)):
            return
        try:
            cmap = self.env.cmap()
            asyncio.run(self._plant(cmap, tid, FragmentKey(ino, chunk, pos, rec.generation), payload))
        except TierFSError:
            self.counts["forge_failed"] = self.counts.get("forge_failed", 0) + 1
            return
        self.forged[(ino, chunk, pos, rec.generation)] = crc
        self.counts["forged"] = self.counts.get("forged", 0) + 1

    async def _plant(self, cmap: pb.ClusterMap, tid: int, key: FragmentKey, payload: bytes) -> None:
        from tests.repair.util import grant_all
        from tierfs.net import DataClient

        addr = {n.node_id: n.data_addr for n in cmap.nodes}
        routes = {t.target_id: addr[t.node_id] for t in cmap.targets}
        async with grant_all(DataClient(routes=routes, request_timeout=2.0, connect_timeout=1.0), self.env.cl) as dc:
            await dc.write(tid, key, payload)

    def op_target_rm(self, node: str) -> None:
        tid = self.env.target_of_node(node)
        out, err = io.StringIO(), io.StringIO()
        # --force: the walk declares the target dead whatever else is down
        # (a node it killed); its files are within their redundancy.
        code = cli(["target", "rm", str(tid), "--force", "--json", "--meta", ",".join(self.env.meta)],
                   stdout=out, stderr=err)
        if code != 0:
            self.violation("rebuild", f"tierfs target rm {tid} exited {code}: {err.getvalue()[-500:]}")
            return
        self.env.removed.add(tid)
        if not self.env.wait_rebuilt():
            # Not TierFS's fault where this walk's own damage (corrupted or
            # forged fragments no read or scrub had healed yet) left some
            # chunk fewer than K valid fragments off the removed target: no
            # system could rebuild it (seen: seed 17000, two fragments of a
            # chunk corrupted, then the target of a third removed).
            with contextlib.suppress(TierFSError):
                truth = self._truth()
                for ino, recs in truth.records.items():
                    codec, _cs = truth.widths[ino]
                    need = 1 if codec.replicated else codec.k
                    for idx in recs:
                        # (the truth ignores the removed target's disk)
                        if len(self._good(truth, ino, idx)) >= need:
                            continue
                        self.counts["rebuild_past_injected_damage"] = (
                            self.counts.get("rebuild_past_injected_damage", 0) + 1)
                        return
            self.violation("rebuild", f"the groups of removed target {tid} still rebuild after 30 s")

    def op_squeeze(self, node: str) -> None:
        """``node`` "moving": the node of a rebalance move's destination in
        flight, if any (its copy then cannot go on: the leader redirects
        it after ``rebalance_redirect_after``), else the last one grown."""
        if node == "moving":
            dests = sorted(t for g in self.env.cmap().groups
                           for t, src in zip(g.rebuilding, g.rebuild_sources, strict=False) if src)
            names = [self.env.node_of_target(t) for t in dests]
            names = [n for n in names if n not in self.env.down and n not in self.env.squeezed]
            node = names[0] if names else (self.grown[-1] if self.grown else "")
            if not node or node in self.env.down or node in self.env.squeezed:
                return
            self.counts["squeezed_moving"] = self.counts.get("squeezed_moving", 0) + int(bool(names))
        self.env.squeeze(node)
        self.counts["squeezed"] = self.counts.get("squeezed", 0) + 1

    def op_unsqueeze(self, node: str) -> None:
        self.env.unsqueeze(node)

    def op_grow(self) -> None:
        """One more storage daemon joins while the walk goes on: group
        members move onto it (copied under the storage daemons'
        ``rebuild_rate``) while files are written, read, truncated and
        renamed and nodes are killed, and every read must still return
        committed bytes."""
        try:
            name = self.env.grow()
        except AssertionError as exc:
            self.violation("grow", f"a new storage daemon did not come online: {exc}")
            return
        self.counts["grown"] = self.counts.get("grown", 0) + 1
        self.grown.append(name)

    def op_scrub(self, repair: bool = True) -> dict[str, Any]:
        """Heal, scrub (repairing, or only reporting), and check the verdict:
        a report that calls the cluster clean must be right about the truth
        on disk, computed after the pass."""
        self.env.heal()
        rebuilt = self.env.wait_rebuilt(5.0 if self.counts.get("violation:rebuild") else 30.0)
        gc_before = gc_known(self.env.meta, self.env.cl.dir)
        rep = asyncio.run(scrub_cluster(self.env.meta, repair=repair, delete_orphans=repair, timeout=120))
        truth = self._truth(gc_before)
        tot = dict(rep["total"])
        for k in ("stale", "mismatched", "chunks_verified"):
            tot[k] = sum(int(n.get(k, 0)) for n in rep["nodes"] if "error" not in n)
        says_clean = (bool(rep["clean"]) and not rep["offline_nodes"] and tot["stale"] == 0
                      and tot["mismatched"] == 0)
        self.scrubs.append({"report": tot, "clean": says_clean, "truth_clean": truth.clean})
        self.counts["scrub_clean" if says_clean else "scrub_found"] = (
            self.counts.get("scrub_clean" if says_clean else "scrub_found", 0) + 1)
        errs = [f"node {n['node']}: {n['error']}" for n in rep["nodes"] if "error" in n]
        if errs:
            tot["node_errors"] = errs[:3]
        if not rebuilt:
            # The scrub leaves groups being rebuilt to the rebuild worker; the
            # stuck rebuild is reported already.
            self.counts["scrub_unchecked"] = self.counts.get("scrub_unchecked", 0) + 1
        elif says_clean and not truth.clean:
            self.violation("scrub", f"scrub called the cluster clean ({_totals(tot)}) but {truth.summary()}")
        return {"clean": says_clean, "truth": truth, "report": tot}

    # ---- the end of a run ---------------------------------------------------------------------

    def finish(self) -> None:
        """Close every handle, heal, read every file back, then scrub until a
        pass finds nothing (at most 3): by then the truth must be clean."""
        for hid in sorted(self.model.handles):
            self.log.append(("close", hid))
            self.op_close(hid)
        self.env.stop_meta_nemesis()  # the final checks run on a quiet meta
        self.log.append(("settle",))
        self.env.heal()
        self.log.append(("fresh_client",))
        self.op_fresh_client()
        for path in sorted(self.model.files):
            self.log.append(("read_file", path))
            self.op_read_file(path)
        last: dict[str, Any] = {}
        for _ in range(3):
            self.log.append(("scrub",))
            last = self.op_scrub()
            if last["clean"]:
                break
        if not last["clean"]:
            self.violation("converge", f"3 repairing scrub passes on a healed cluster still find problems "
                           f"({_totals(last['report'])}); {last['truth'].summary()}")
        elif not last["truth"].clean:
            pass  # reported by op_scrub already
        for path in sorted(self.model.files):
            self.log.append(("read_file", path))
            self.op_read_file(path)


def save_log(log_dir: Path | None, name: str, root: str, seed: int | None, ops: Sequence[Op],
             violations: Sequence[str]) -> Path | None:
    """A failed walk's op log as JSON (replayable), under ``log_dir``."""
    if log_dir is None:
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / name
    path.write_text(json.dumps({"root": root, "seed": seed, "ops": list(ops), "violations": list(violations)},
                               indent=0))
    return path


def own_failure(exc: BaseException, step: int) -> str:
    """What a violation says when the checker itself failed."""
    tb = "".join(traceback.format_exception(exc, limit=-6))
    return f"the checker itself failed at step {step}: {type(exc).__name__}: {exc}\n{tb}"


def listing(ops: Sequence[Op]) -> str:
    return "\n".join(f"  {i + 1:4d} {op!r}" for i, op in enumerate(ops))


def _path_of(model: Model, f: MFile) -> str:
    return next(p for p, x in model.files.items() if x is f)


async def _stat(meta: list[str], path: str) -> pb.FileInfo:
    async with MetaClient(meta, deadline=20) as mc:
        return await mc.stat(path)


def _totals(t: dict[str, Any]) -> str:
    keys = ("fragments", "corrupt", "missing", "stale", "mismatched", "repaired", "orphans", "orphans_deleted",
            "errors", "unreachable")
    out = ", ".join(f"{k} {t.get(k, 0)}" for k in keys)
    return out + (f"; unreachable: {t['node_errors']}" if t.get("node_errors") else "")


def _describe(b: bytes) -> str:
    if not b:
        return "0 bytes"
    runs: list[str] = []
    i = 0
    while i < len(b) and len(runs) < 4:
        j = i
        while j < len(b) and b[j] == b[i]:
            j += 1
        if j - i >= 16:
            runs.append(f"{j - i} x {bytes([b[i]])!r}")
        else:
            runs.append(f"{b[i:i + 8].hex()}...")
            j = max(j, i + 8)
        i = j
    return f"{len(b)} bytes [{', '.join(runs)}{', ...' if i < len(b) else ''}]"


def _first_diff(a: bytes, b: bytes) -> str:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return f" (first difference at byte {i}: got {a[i]:#04x}, model {b[i]:#04x})"
    return f" (lengths {len(a)} and {len(b)})" if len(a) != len(b) else ""


# ---- the random walk ---------------------------------------------------------------------------

SIZES = (1, 100, 1000, 4095, 64 * KiB - 1, 64 * KiB, 64 * KiB + 1, 100 * KiB, 200 * KiB)
MODES = ("r", "r+", "w", "w+", "a", "a+", "x", "x+")


def meta_fault(env: CheckerCluster, rng: random.Random, p: float = 0.05) -> Op | None:
    """With three meta replicas or more, now and then (``p``): one SIGKILLed
    (the leader, mostly), or all of them at once, or the one down restarted."""
    metas = env.metas()
    if len(metas) < 3 or rng.random() >= p:
        return None
    if env.meta_down:
        return ("meta_restart", sorted(env.meta_down)[0])
    if rng.random() < 0.15:
        return ("meta_crash_all",)
    return ("meta_kill", "leader" if rng.random() < 0.7 else rng.choice(metas))


def random_ops(ck: Checker, rng: random.Random, steps: int, *, cs: int = 64 * KiB, max_down: int = 2,
               n_files: int = 4, target_rm: bool = True, grow: int = 0, squeeze: bool = False) -> Iterator[Op]:
    """``steps`` operations drawn from ``rng``, each looking at the model
    (which handles are open, which files exist) and at the faults active.
    At most ``max_down`` storage nodes are down or stopped at once. With
    three meta replicas, one of them (the leader, mostly) is SIGKILLed now
    and then and restarted later: every call must go on through the
    failover. ``grow``: storage daemons the walk may add (``("grow",)``,
    while no node is down), each starting rebalance moves that run on
    through the steps after it; 0 leaves a seed's walk as it always was.
    ``squeeze``: now and then one storage daemon (a grown one first: the
    destination of moves in flight) is restarted with its target full, and
    later back to normal (``("squeeze", node)``, ``("unsqueeze", node)``);
    off leaves a seed's walk as it was."""
    names = [f"f{i}" for i in range(n_files)]
    env = ck.env
    removed_once = False
    grown = 0
    nh = 0

    def offset(size: int) -> int:
        r = rng.random()
        if r < 0.3:
            return rng.choice([0, size])
        if r < 0.6:  # next to a chunk boundary
            return max(0, rng.randrange(0, size // cs + 2) * cs + rng.choice([-1, 0, 1]))
        return rng.randrange(0, size + cs)

    def data() -> tuple[str, int, int]:
        return ("rand", rng.randrange(1 << 30), rng.choice(SIZES))

    for _ in range(steps):
        handles = ck.model.handles
        up = [n for n in env.storage() if n not in env.down]
        mf = meta_fault(env, rng)
        if mf is not None:
            yield mf
            continue
        r = rng.random()
        if r < 0.04 and len(env.down) < max_down:
            yield ("kill", rng.choice(up))
        elif r < 0.06 and len(env.down) < max_down:
            yield ("stop", rng.choice(up))
        elif r < 0.11 and env.down:
            node = rng.choice(sorted(env.down))
            yield ("restart" if env.down[node] == "killed" else "cont", node)
        elif r < 0.13 and not any(h.writable for h in handles.values()):
            yield ("scrub",)
        elif r < 0.14 and target_rm and not removed_once and not env.removed and not env.down:
            removed_once = True
            yield ("target_rm", rng.choice(up))
        elif grow and r < 0.15 and grown < grow and not env.down:
            grown += 1
            yield ("grow",)
            if squeeze and not env.squeezed and rng.random() < 0.5:
                yield ("squeeze", "moving")  # a destination of the moves the growth starts
        elif squeeze and r < 0.153 and not env.down and not env.squeezed:
            grown_up = [n for n in ck.grown if n in up]
            yield ("squeeze", rng.choice(grown_up or up))
        elif squeeze and r < 0.156 and env.squeezed and not env.down:
            yield ("unsqueeze", sorted(env.squeezed)[0])
        elif r < 0.16 and ck.model.files:
            path = rng.choice(sorted(ck.model.files))
            size = max((len(c) for c in ck.model.files[path].cands), default=0)
            if size:
                yield (rng.choice(("corrupt", "forge")), path, rng.randrange(-(-size // cs)), rng.randrange(6))
        elif r < 0.18:
            yield ("fresh_client",)
        elif r < 0.22 and ck.model.files and len(handles) < 3:
            # A reader holds the file open while it is rewritten (whole, or
            # through a writer), then reads on: each call must return one
            # committed version, never a mix.
            nh += 1
            path = rng.choice(sorted(ck.model.files))
            rh = f"h{nh}"
            yield ("open", rh, path, "r")
            yield ("read", rh, rng.choice([1, 1000, cs - 3]))
            if rng.random() < 0.5:
                yield ("write_file", path, data())
            else:
                nh += 1
                yield ("open", f"h{nh}", path, rng.choice(["r+", "a", "w"]))
                yield ("write", f"h{nh}", offset(cs), data())
                yield ("close", f"h{nh}")
            for _ in range(rng.randrange(1, 4)):
                yield ("read", rh, rng.choice([-1, 1, 1000, cs // 2 - 1, cs, 2 * cs + 5]))
            if rng.random() < 0.7:
                yield ("close", rh)
        elif r < 0.25 and len(handles) < 3 and len(env.down) < max_down:
            # A chunk rewritten in one session while a node is away: flushed,
            # a node killed, written again, closed, the node back, a fresh
            # client reads (the node returns with the first upload).
            nh += 1
            wh, path = f"h{nh}", rng.choice(names)
            yield ("open", wh, path, rng.choice(["w", "r+", "a", "w+"]))
            at = rng.randrange(0, 3) * cs + rng.choice([0, 1, cs // 3])
            yield ("write", wh, at, data())
            yield ("flush", wh)
            # The node of one of the chunk's data fragments (fragment 0 holds
            # every byte of a chunk shorter than a fragment).
            yield ("kill_holder", path, at // cs, rng.choice([0, 0, 1, 2, 3]))
            yield ("write", wh, at + rng.choice([0, 1000, cs // 2]), data())
            yield ("close", wh)
            yield ("settle",)
            yield ("fresh_client",)
            yield ("read_file", path)
        elif r < 0.34 and len(handles) < 3:
            nh += 1
            mode = rng.choice(MODES)
            have = sorted(ck.model.files)
            path = rng.choice(have) if have and mode[0] in "ra" and rng.random() < 0.8 else rng.choice(names)
            yield ("open", f"h{nh}", path, mode)
        elif r < 0.62 and handles:
            hid = rng.choice(sorted(handles))
            h = handles[hid]
            q = rng.random()
            if q < 0.45:
                yield ("write", hid, None if rng.random() < 0.4 else offset(h.size()), data())
            elif q < 0.68:
                yield ("read", hid, rng.choice([-1, 1, 1000, cs // 2 - 1, cs, cs + 5]))
            elif q < 0.78:
                yield ("seek", hid, offset(h.size()))
            elif q < 0.85:
                yield ("flush", hid)
            elif q < 0.97:
                yield ("close", hid)
            else:
                yield ("abort", hid)
        elif r < 0.70:
            yield ("write_file", rng.choice(names), data())
        elif r < 0.80:
            yield ("read_file", rng.choice(names))
        elif r < 0.84 and ck.model.files:
            path = rng.choice(sorted(ck.model.files))
            size = max(len(c) for c in ck.model.files[path].cands)
            yield ("read_range", path, offset(size), rng.choice([1, 777, cs, 2 * cs + 3]))
        elif r < 0.92:
            path = rng.choice(names)
            size = max((len(c) for c in ck.model.files[path].cands), default=0) if path in ck.model.files else 0
            yield ("truncate", path, rng.choice([0, 1, 6, size // 2, size + 3000, size + cs + 1, offset(size)]))
        elif r < 0.96:
            yield ("rename", rng.choice(names), rng.choice(names))
        else:
            yield ("unlink", rng.choice(names))
