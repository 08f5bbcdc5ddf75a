"""A randomized soak: client writes, reads and deletes mixed with random
faults — SIGKILL and restart of a storage daemon, SIGSTOP and SIGCONT, a
fragment corrupted on disk, drop/stall/reset/truncate on one node's data
plane (through a TCP fault proxy) — and now and then a ``tierfs scrub``
that must repair the corruption, on a real 3-meta, 6-storage cluster.

Invariant, checked on every read and again at the end: every acknowledged
file reads back exactly; a failed write leaves no visible partial file; a
deleted file is gone; with the faults cleared the cluster is healthy and,
after a scrub, has no corrupt or missing fragment left.

Deterministic choices from a fixed seed (``TIERFS_SOAK_SEED``, default 1);
runs for ``TIERFS_SOAK_SECONDS`` (default 30; ``make soak`` runs 600).
At most one transient fault (a node down or stopped, or a proxy fault) is
active at a time and at most one fragment per chunk is corrupted, so every
chunk keeps at least K=4 good fragments of 6 (a scrub resets the count):
reads must succeed, and any read error is reported as a failure too.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.faults.harness import FaultCluster, Ledger, MiB, digest, fragment_files, random_bytes
from tierfs.cli.main import run
from tierfs.client import Client
from tierfs.errors import TierFSError

SECONDS = float(os.environ.get("TIERFS_SOAK_SECONDS", "30"))
SEED = int(os.environ.get("TIERFS_SOAK_SEED", "1"))
PROXIED = "storage-5"
PROXY_FAULTS = ("drop", "stall", "reset", "truncate", "delay")


@dataclass
class Soak:
    fc: FaultCluster
    client: Client
    rng: random.Random
    ledger: Ledger = field(default_factory=Ledger)
    fault: str = ""  # the transient fault now active ("" = none)
    faulty: str = ""  # the node it is on
    damaged: dict[str, set[int]] = field(default_factory=dict)  # path -> chunks with a corrupt fragment
    counts: dict[str, int] = field(default_factory=dict)
    wrong: list[str] = field(default_factory=list)
    read_errors: list[str] = field(default_factory=list)
    n_files: int = 24

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    # --- client operations --------------------------------------------------------

    def write(self) -> None:
        path = f"/soak/f{self.rng.randrange(self.n_files)}"
        size = self.rng.choice([0, 1, 4095, 64 << 10, MiB - 1, MiB + 1, 3 * MiB + 7, 6 * MiB])
        degraded = self.client.aclient.degraded_writes
        ok = self.ledger.write(self.client, path, random_bytes(size, seed=self.rng.randrange(1 << 30)))
        self.damaged.pop(path, None)
        if ok and self.client.aclient.degraded_writes > degraded:
            # Written degraded (K+1 of K+M fragments): one fragment of a chunk is
            # already missing until a scrub or the node's catch-up, so no
            # fragment of it is damaged on top (at most M unavailable).
            self.damaged[path] = set(range(max(1, -(-size // MiB))))
            self.count("write_degraded")
        self.count("write_ok" if ok else "write_failed")
        if not ok and not self.fault:
            self.read_errors.append(f"write of {path} failed on a healthy cluster: {self.ledger.errors[-1]}")

    def read(self) -> None:
        if not self.ledger.acked:
            return
        path = self.rng.choice(sorted(self.ledger.acked))
        want = self.ledger.acked[path]
        try:
            if len(want) > 2 and self.rng.random() < 0.5:
                a = self.rng.randrange(len(want))
                b = self.rng.randrange(a, len(want) + 1)
                with self.client.open(path, "rb") as f:
                    f.seek(a)
                    got = f.read(b - a)
                if got != want[a:b]:
                    self.wrong.append(f"{path}[{a}:{b}] wrong under {self.fault or 'no fault'}")
            else:
                got = self.client.read_bytes(path)
                if digest(got) != digest(want):
                    self.wrong.append(f"{path} wrong under {self.fault or 'no fault'}")
            self.count("read")
        except TierFSError as exc:
            self.read_errors.append(f"{path} under {self.fault or 'no fault'}: {type(exc).__name__}: {exc}")

    def delete(self) -> None:
        if not self.ledger.acked:
            return
        path = self.rng.choice(sorted(self.ledger.acked))
        ok = self.ledger.rm(self.client, path)
        self.damaged.pop(path, None)
        self.count("rm_ok" if ok else "rm_failed")

    # --- faults ---------------------------------------------------------------------

    def start_fault(self) -> None:
        kind = self.rng.choice(["kill", "stop", "proxy", "proxy"])
        if kind == "proxy":
            mode = self.rng.choice(PROXY_FAULTS)
            px = self.fc.proxies[PROXIED]
            if mode == "truncate":
                px.set(mode, nbytes=self.rng.randrange(1, 600_000), direction=self.rng.choice(["up", "down"]))
            elif mode == "delay":
                px.set(mode, delay=self.rng.choice([0.01, 0.1, 0.3]))
            else:
                px.set(mode, direction=self.rng.choice(["up", "down", "both"]))
            self.fault, self.faulty = f"proxy:{mode}", PROXIED
        else:
            name = f"storage-{self.rng.randrange(6)}"
            self.fc.cl.kill(name, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            self.fault, self.faulty = kind, name
        self.count(self.fault)

    def end_fault(self) -> None:
        if self.fault.startswith("proxy:"):
            self.fc.proxies[PROXIED].set("pass")
        elif self.fault == "stop":
            os.kill(self.fc.cl.proc(self.faulty).pid, signal.SIGCONT)
        elif self.fault == "kill":
            self.fc.cl.start(names=[self.faulty], timeout=60)
        self.fault = self.faulty = ""
        # Back to healthy before the next fault: one fault at a time.
        asyncio.run(self.fc.cl.wait_healthy(60))

    def scrub(self) -> dict[str, int]:
        """``tierfs scrub`` on a healthy cluster: every corrupt fragment is
        rebuilt, so chunks may be damaged again afterwards."""
        out = io.StringIO()
        code = run(["scrub", "--json", "--meta", ",".join(self.fc.meta_addrs)], stdout=out, stderr=io.StringIO())
        doc = json.loads(out.getvalue())
        if code != 0 or doc["total"].get("errors", 0):
            self.read_errors.append(f"scrub on a healthy cluster failed: {doc.get('total')}")
            return {}
        self.damaged.clear()
        self.count("scrub")
        self.counts["scrub_repaired"] = self.counts.get("scrub_repaired", 0) + int(doc["total"].get("repaired", 0))
        return {k: int(v) for k, v in doc["total"].items() if isinstance(v, int | float)}

    def corrupt(self) -> None:
        """Flip a byte in one fragment of a chunk that has none damaged yet."""
        if not self.ledger.acked:
            return
        path = self.rng.choice(sorted(self.ledger.acked))
        try:
            ino = self.client.stat(path).inode
        except TierFSError:
            return
        by_chunk: dict[int, list[tuple[int, Path]]] = {}
        for f in fragment_files(self.fc.cl):
            if f.parent.name == f"{ino:016x}":
                chunk, _frag, ver = (int(x, 16) for x in f.name.split("."))
                by_chunk.setdefault(chunk, []).append((ver, f))
        done = self.damaged.setdefault(path, set())
        free = sorted(c for c in by_chunk if c not in done)
        if not free:
            return
        chunk = self.rng.choice(free)
        newest = max(v for v, _ in by_chunk[chunk])
        victim = self.rng.choice(sorted(f for v, f in by_chunk[chunk] if v == newest))
        try:
            size = victim.stat().st_size
            with open(victim, "r+b") as fh:
                pos = self.rng.randrange(size)
                fh.seek(pos)
                b = fh.read(1)
                fh.seek(pos)
                fh.write(bytes([b[0] ^ 0x5A]))
        except (FileNotFoundError, IndexError):
            return  # replaced or collected meanwhile
        done.add(chunk)
        self.count("corrupt")


@pytest.fixture(scope="module")
def fc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    c = FaultCluster(tmp_path_factory.mktemp("soak"), proxied=[PROXIED])
    yield c
    c.close()


@pytest.mark.timeout(SECONDS + 240)
def test_randomized_soak(fc: FaultCluster) -> None:
    rng = random.Random(SEED)
    with fc.client(request_timeout=1.0, connect_timeout=1.0, retries=2) as client:
        client.mkdir("/soak")
        client.set_layout("/soak", chunk_size=MiB)
        s = Soak(fc, client, rng)
        t_end = time.monotonic() + SECONDS
        fault_until = 0.0
        while time.monotonic() < t_end:
            now = time.monotonic()
            if s.fault and now >= fault_until:
                s.end_fault()
            r = rng.random()
            if not s.fault and r < 0.08:
                s.start_fault()
                fault_until = time.monotonic() + rng.uniform(0.5, 3.0)
            elif r < 0.12:
                s.corrupt()
            elif r < 0.13 and not s.fault:
                s.scrub()
            elif r < 0.45:
                s.write()
            elif r < 0.52:
                s.delete()
            else:
                s.read()
        if s.fault:
            s.end_fault()
        fc.restart_all()
        # Full redundancy again: a scrub repairs what was corrupted, a second finds nothing.
        s.scrub()
        again = s.scrub()
        assert again and again.get("corrupt", 1) == 0 and again.get("missing", 1) == 0, again
        checked = s.ledger.verify(client)
        print(f"\nsoak seed={SEED} {SECONDS:.0f}s: {dict(sorted(s.counts.items()))}; "
              f"{len(s.ledger.acked)} files ({checked} bytes) verified at the end; "
              f"read errors {len(s.read_errors)}")
        assert not s.wrong, s.wrong
        assert not s.read_errors, s.read_errors[:5]
        assert s.counts.get("write_ok", 0) > 0 and s.counts.get("read", 0) > 0
        # The cluster takes new writes after all that.
        assert s.ledger.write(client, "/soak/final", random_bytes(2 * MiB, seed=SEED)), s.ledger.errors[-1:]
        s.ledger.verify(client)
    asyncio.run(fc.cl.wait_healthy(30))
