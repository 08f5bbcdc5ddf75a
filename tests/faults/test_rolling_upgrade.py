"""A rolling upgrade from the previous release, rehearsed under load.

The previous release is the code of the last landed stop (``PREVIOUS``,
taken from this repository's history with ``git archive``); its daemons
run from that tree in this suite's virtualenv (the same pinned
dependencies). The procedure is the one docs/operations.md ("Rolling
upgrades") gives operators:

1. a file is written by the previous release's CLI;
2. storage daemons are upgraded one at a time, then the meta followers,
   then the leader, each restarted with the new code, waiting after each
   for ``tierfs status`` to be healthy (every daemon up, no group degraded
   or rebuilding, no repair pending);
3. throughout, a writer using the new client keeps writing and recording
   what was acknowledged;
4. then every acknowledged byte reads back, the file written before the
   upgrade reads back through the new client, and a file written after it
   reads back through the previous release's CLI (clients are upgraded
   after the servers).

A change to a wire format, the journal, a snapshot, a fragment file or a
daemon flag that the previous release cannot live with fails here.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import Ledger, digest, random_bytes
from tests.kv.pools import define_pool, pool_served
from tierfs.cli.cluster import cluster_status
from tierfs.cli.main import render_status
from tierfs.client import Client
from tierfs.errors import TierFSError
from tierfs.local import LocalCluster

pytestmark = pytest.mark.timeout(300)

#: The last landed stop's commit: the release a deployment runs when this
#: code reaches it. Move it forward when a stop lands (docs/operations.md).
PREVIOUS = "4c40f6c4c6b15ac207fcdac38e8a09c2ac7f09ba"

REPO = Path(__file__).resolve().parents[2]


#: The last release whose meta took any KV policy name of the right form
#: (later ones refuse a policy that does not exist).
POLICY_FORM_ONLY = "354f6ac7880d26e639b4a7b3b412f4331e5287d9"


def _previous_tree(dest: Path, commit: str = PREVIOUS) -> Path:
    """The ``tierfs`` package of ``commit`` (the previous release) under ``dest``."""
    try:
        tar = subprocess.run(["git", "-C", str(REPO), "archive", commit, "tierfs"], check=True,
                             capture_output=True, timeout=60).stdout
    except subprocess.CalledProcessError as exc:
        raise AssertionError(
            f"the rolling-upgrade rehearsal needs commit {commit} in this clone's history "
            f"(a full `git clone`, not a shallow one): {exc.stderr.decode(errors='replace')}") from None
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=tar, check=True, timeout=60)
    return dest


def _python_in(tree: Path, at: Path) -> str:
    """An interpreter that runs ``python -m tierfs...`` from ``tree`` (its
    working directory comes first on sys.path), in this suite's venv."""
    at.write_text(f"#!/bin/sh\ncd '{tree}' && exec '{sys.executable}' \"$@\"\n")
    at.chmod(0o755)
    return str(at)


def _code_of(pid: int) -> Path:
    """Where a daemon's ``tierfs`` package comes from: its working directory."""
    return Path(os.readlink(f"/proc/{pid}/cwd"))


def _old_cli(python: str, cl: LocalCluster, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return subprocess.run([python, "-m", "tierfs.cli", "--data", str(cl.dir), *args], capture_output=True,
                          timeout=60, env=env, check=False)


def _wait_status_healthy(cl: LocalCluster, timeout: float, step: str) -> None:
    end = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < end:
        try:
            st = asyncio.run(cluster_status(cl.meta_addrs, data_dir=str(cl.dir), timeout=3.0))
            if st["healthy"]:
                return
            last = {k: st[k] for k in ("leader", "repairs_pending")} | {
                "down": [m["addr"] for m in st["meta"] if m["state"] != "up"]
                + [s["name"] for s in st["storage"] if s["state"] != "online"],
                "groups": sorted({g["state"] for g in st["groups"]})}
        except Exception as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.2)
    raise AssertionError(f"after {step}: `tierfs status` not healthy within {timeout:.0f} s: {last}")


def test_rolling_upgrade_from_the_previous_release_under_load(tmp_path: Path) -> None:
    old_py = _python_in(_previous_tree(tmp_path / "previous"), tmp_path / "python-previous")
    cl = LocalCluster(tmp_path / "c", n_meta=3, n_storage=6, python=old_py,
                      extra_storage_args=["--heartbeat-interval=0.2", "--repair-interval=0.3"])
    try:
        cl.up(timeout=90)
        # The running daemons are the previous release's code.
        assert {_code_of(p.pid) for p in cl.procs} == {tmp_path / "previous"}
        before = random_bytes(3 << 20, 901)
        (tmp_path / "before.bin").write_bytes(before)
        r = _old_cli(old_py, cl, "put", str(tmp_path / "before.bin"), "/before.bin")
        assert r.returncode == 0, r.stderr.decode()
        # A KV object too (the default pool keeps it on disk across restarts).
        kv_before = random_bytes(300_000, 903)
        (tmp_path / "kv-before.bin").write_bytes(kv_before)
        r = _old_cli(old_py, cl, "kv", "put", "upgrade-kv-before", str(tmp_path / "kv-before.bin"))
        assert r.returncode == 0, r.stderr.decode()
        # A replica pool read by this release's client from daemons of the
        # previous one: its copy check asks the other copy's daemon for the
        # key's CRC32C (KV_EXISTS with KV_WITH_CRC, which the previous
        # release answers since stop 39), and the hit is witnessed.
        define_pool(cl.meta_addrs, "upgrade-r2", redundancy="replica:2", target_memory=32 << 20,
                    target_disk=64 << 20)
        pool_served(cl.meta_addrs, "upgrade-r2")
        r2_value = random_bytes(70_000, 904)
        with Client(cl.meta_addrs, request_timeout=5.0) as c:
            assert c.kv_pool("upgrade-r2").put("upgrade-r2-key", r2_value)
        with Client(cl.meta_addrs, request_timeout=5.0) as c:  # knows no CRC32C of the key
            kv = c.kv_pool("upgrade-r2")
            assert kv.get("upgrade-r2-key") == r2_value
            assert kv.stats()["cluster"]["unwitnessed"] == 0 and kv.stats()["cluster"]["disagreements"] == 0

        ledger = Ledger()
        stop = threading.Event()
        writes = {"n": 0}
        # KV through this release's client while daemons of both releases
        # serve (stamped puts, gets and deletes to daemons that ignore the
        # stamps, then to ones that check them): a value acknowledged reads
        # back as itself or a miss, never another, and an acknowledged
        # delete leaves a miss.
        kv_ops = {"ok": 0, "errors": 0}
        kv_wrong: list[str] = []

        def kv_round(c: Client, i: int) -> None:
            key, value = f"upgrade-kv-load-{i % 8}", random_bytes(40_000 + i, 3000 + i)
            try:
                assert c.kv.put(key, value, overwrite=True)
                got = c.kv.get(key)
                if got not in (None, value):
                    kv_wrong.append(f"{key}: {len(got)} bytes, not the value just put")
                c.kv.delete(key)
                if (got := c.kv.get(key)) is not None:
                    kv_wrong.append(f"{key}: {len(got)} bytes after an acknowledged delete")
                kv_ops["ok"] += 1
            except TierFSError:
                kv_ops["errors"] += 1  # its daemon restarting

        def writer() -> None:
            with Client(cl.meta_addrs, request_timeout=2.0, kv_timeout=1.0) as c:
                c.mkdir("/load", exist_ok=True)
                i = 0
                while not stop.is_set():
                    ledger.write(c, f"/load/f{i % 40}", random_bytes(200_000 + 997 * i, 1000 + i))
                    kv_round(c, i)
                    writes["n"] += 1
                    i += 1

        t = threading.Thread(target=writer, daemon=True)
        t.start()
        try:
            order = [p.name for p in cl.procs if p.kind == "storage"]
            h = asyncio.run(cl.wait_healthy(30))
            leader = next(m["addr"] for m in h["meta"] if m["role"] == "leader")
            metas = [p for p in cl.procs if p.kind == "meta"]
            order += [p.name for p in metas if p.addr != leader] + [p.name for p in metas if p.addr == leader]
            for name in order:
                n0 = writes["n"]
                cl.stop(names=[name])
                cl.python = sys.executable
                cl.start(names=[name], timeout=60)
                cl.python = old_py
                _wait_status_healthy(cl, 60, f"upgrading {name}")
                # The writer got acknowledged writes in between (it never stalled for long).
                end = time.monotonic() + 30
                while writes["n"] < n0 + 2 and time.monotonic() < end:
                    time.sleep(0.05)
                assert writes["n"] >= n0 + 2, f"no write completed after upgrading {name}: {ledger.errors[-3:]}"
        finally:
            stop.set()
            t.join(60)
        assert not t.is_alive()
        assert len(ledger.acked) >= 10, ledger.errors[-5:]
        assert kv_wrong == []
        print(f"KV rounds during the upgrade: {kv_ops}")
        assert kv_ops["ok"] >= 10, kv_ops

        with Client(cl.meta_addrs, request_timeout=5.0) as c:
            assert ledger.verify(c) > 0
            assert digest(c.read_bytes("/before.bin")) == digest(before)
            after = random_bytes(2 << 20, 902)
            c.write_bytes("/after.bin", after)
            # The previous release's KV object, through the new client (its
            # daemons restarted with their disk copies, never marked down).
            assert c.kv.get("upgrade-kv-before") == kv_before
            kv_after = random_bytes(200_000, 904)
            assert c.kv.put("upgrade-kv-after", kv_after)
        # Every daemon now runs the new code.
        assert {_code_of(p.pid) for p in cl.procs} == {Path.cwd()}
        # A client of the previous release reads what the new one wrote.
        r = _old_cli(old_py, cl, "get", "/after.bin", str(tmp_path / "after.bin"))
        assert r.returncode == 0, r.stderr.decode()
        assert digest((tmp_path / "after.bin").read_bytes()) == digest(after)
        r = _old_cli(old_py, cl, "kv", "get", "upgrade-kv-after", str(tmp_path / "kv-after.bin"))
        assert r.returncode == 0, r.stderr.decode()
        assert (tmp_path / "kv-after.bin").read_bytes() == kv_after
    finally:
        cl.stop()


def test_a_pool_whose_policy_daemons_lack_is_seen_by_status_and_served_after_the_upgrade(tmp_path: Path) -> None:
    """A meta of a release that took any policy name of the right form
    defines a KV pool whose eviction policy no daemon has. The daemons of
    that release cannot apply the map (each heartbeat and map update
    raises), so none holds a KV map lease: every pool, the default one too,
    misses on gets and refuses puts. Meta of this release says so in
    ``tierfs status`` (degraded, the nodes named); daemons of this release
    run the pool with LRU, say so in their log, and KV works again."""
    from tests.kv.pools import define_pool, pool_served

    old_py = _python_in(_previous_tree(tmp_path / "old", POLICY_FORM_ONLY), tmp_path / "python-old")
    cl = LocalCluster(tmp_path / "c", n_meta=1, n_storage=3, python=old_py,
                      extra_storage_args=["--heartbeat-interval=0.2"])

    def status() -> dict[str, Any]:
        return asyncio.run(cluster_status(cl.meta_addrs, data_dir=str(cl.dir), timeout=5.0))

    def wait(cond: Callable[[dict[str, Any]], bool], what: str, timeout: float = 60) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            st = status()
            if cond(st):
                return st
            if time.monotonic() > end:
                raise AssertionError(f"{what}: not within {timeout:.0f} s: {st.get('kv_leases')}")
            time.sleep(0.3)

    try:
        cl.up(timeout=90)
        storage = [p.name for p in cl.procs if p.kind == "storage"]
        meta = [p.name for p in cl.procs if p.kind == "meta"]
        define_pool(cl.meta_addrs, "oddpolicy", target_memory=8 << 20, policy="no-such-policy")
        cl.python = sys.executable
        cl.stop(names=meta)
        cl.start(timeout=60, names=meta)
        st = wait(lambda st: bool(st["kv_leases"]) and len(st["kv_leases"]["stalled"]) == 3,
                  "every old daemon called stalled")
        assert not st["healthy"]
        assert "hold no KV map lease" in render_status(st)
        with Client(cl.meta_addrs, request_timeout=3.0, kv_timeout=1.0) as c, pytest.raises(TierFSError):
            c.kv.put("while-stalled", b"x" * 1000)
        cl.stop(names=storage)
        cl.start(timeout=60, names=storage)
        assert all(_code_of(p.pid) != tmp_path / "old" for p in cl.procs)
        pool_served(cl.meta_addrs, "oddpolicy")
        st = wait(lambda st: st["healthy"] and not st["kv_leases"]["stalled"], "a healthy cluster, no node stalled")
        assert "kv leases: 3 of 3 online storage nodes leased; map version" in render_status(st)
        with Client(cl.meta_addrs, request_timeout=5.0, kv_timeout=2.0) as c:
            for pool in ("oddpolicy", "default"):
                value = random_bytes(50_000, len(pool))
                assert c.kv_pool(pool).put(f"{pool}-key", value), pool
                assert c.kv_pool(pool).get(f"{pool}-key") == value, pool
        logs = "".join((cl.dir / "logs" / f"{n}.log").read_text() for n in storage)
        assert "asks for eviction policy 'no-such-policy'" in logs and "running LRU" in logs
    finally:
        cl.stop()


#: The last release whose daemons answer KV_EXISTS with its bitmap only
#: (stop 39 added ``KV_WITH_CRC``).
KV_EXISTS_BITMAP_ONLY = "8d4608b00a47f278dd427d6625e7ed8e77f3b44c"


def test_a_replica_get_from_daemons_that_answer_no_crcs_goes_unwitnessed_and_is_served(tmp_path: Path) -> None:
    """Daemons of a release before ``KV_WITH_CRC`` answer the copy check's
    ``KV_EXISTS`` with a bitmap. This release's client tells the answer
    apart by its length: the witness is absent, the hit is served and
    counted as unwitnessed, never taken for a disagreement."""
    old_py = _python_in(_previous_tree(tmp_path / "old", KV_EXISTS_BITMAP_ONLY), tmp_path / "python-old")
    cl = LocalCluster(tmp_path / "c", n_meta=1, n_storage=3, python=old_py,
                      extra_storage_args=["--heartbeat-interval=0.2"])
    try:
        cl.up(timeout=90)
        assert {_code_of(p.pid) for p in cl.procs} == {tmp_path / "old"}
        define_pool(cl.meta_addrs, "bitmap-r2", redundancy="replica:2", target_memory=32 << 20,
                    target_disk=64 << 20)
        pool_served(cl.meta_addrs, "bitmap-r2")
        values = {f"bitmap-key-{i}": random_bytes(20_000 + i, 950 + i) for i in range(4)}
        with Client(cl.meta_addrs, request_timeout=5.0) as c:
            for key, value in values.items():
                assert c.kv_pool("bitmap-r2").put(key, value)
        with Client(cl.meta_addrs, request_timeout=5.0) as c:  # knows no CRC32C of the keys
            kv = c.kv_pool("bitmap-r2")
            assert kv.get("bitmap-key-0") == values["bitmap-key-0"]
            rest = [k for k in values if k != "bitmap-key-0"]
            bufs = [bytearray(len(values[k])) for k in rest]
            assert kv.batch_get_into(rest, bufs) == [len(values[k]) for k in rest]
            assert [bytes(b) for b in bufs] == [values[k] for k in rest]
            st = kv.stats()["cluster"]
            assert st["disagreements"] == 0
            assert st["unwitnessed"] == len(values), st
    finally:
        cl.stop()
