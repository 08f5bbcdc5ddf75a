"""The ``tierfs-storage`` process: serves its targets over the data plane,
keeps its identity across restarts, registers and heartbeats with a real meta
replica, and deletes what meta's GC queue lists."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import MetaCluster
from tierfs.chunk import crc32c, generation
from tierfs.errors import NotFoundError
from tierfs.storage.api import FragmentKey

REPO = Path(__file__).resolve().parents[2]


class Daemon:
    def __init__(self, tmp: Path, args: list[str]) -> None:
        self.tmp, self.args = tmp, args
        self.proc: subprocess.Popen[str] | None = None
        self.ready: dict[str, Any] = {}
        self._log: Any = None

    def start(self, timeout: float = 30.0) -> dict[str, Any]:
        self.spawn()
        return self.wait_ready(timeout)

    def spawn(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self._log = open(self.tmp / "storage.log", "a")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tierfs.storage.daemon", *self.args],
            stdout=subprocess.PIPE, stderr=self._log, env=env, text=True, cwd=str(REPO),
        )

    def wait_ready(self, timeout: float = 30.0) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = self.proc.stdout.readline()  # the daemon prints one line when ready, or exits
        assert time.monotonic() < deadline and line, f"no ready line: {(self.tmp / 'storage.log').read_text()[-3000:]}"
        self.ready = json.loads(line)
        assert self.ready["event"] == "ready"
        return self.ready

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self._log.close()
        self.proc = None
        return rc

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.stop(signal.SIGKILL)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[Daemon]]:
    made: list[Daemon] = []
    yield made
    for d in made:
        d.close()


async def _client_round_trip(addr: str, target: int, key: FragmentKey, data: bytes,
                             caps: tuple[bytes, ...] = ()) -> None:
    from tierfs.net import DataClient

    c = DataClient(transport="tcp", routes={target: addr})
    for cap in caps:  # from meta's replies (a daemon registered with meta requires them)
        c.caps.add(cap)
    try:
        await c.write(target, key, data)
        assert await c.read(target, key) == data
        assert await c.read(target, key, offset=3, length=5) == data[3:8]
        info = await c.stat(target, key)
        assert info.size == len(data)
    finally:
        await c.close()


async def _client_read(addr: str, target: int, key: FragmentKey, caps: tuple[bytes, ...] = ()) -> bytes:
    from tierfs.net import DataClient

    c = DataClient(transport="tcp", routes={target: addr})
    for cap in caps:
        c.caps.add(cap)
    try:
        return await c.read(target, key)
    finally:
        await c.close()


@pytest.mark.timeout(90)
def test_standalone_node_serves_and_survives_restart(tmp_path: Path, daemons: list[Daemon]) -> None:
    args = ["--no-meta", "--data-dir", str(tmp_path / "node"), "--target", str(tmp_path / "t1"),
            "--target", str(tmp_path / "t2"), "--target-id", "11", "--target-id", "12",
            "--reserved-bytes", "0", "--transport", "tcp", "--metrics-addr", "127.0.0.1:0"]
    d = Daemon(tmp_path, args)
    daemons.append(d)
    ready = d.start()
    assert ready["targets"] == {str(tmp_path / "t1"): 11, str(tmp_path / "t2"): 12}
    uuid1 = ready["node_uuid"]
    blobs = {(11, FragmentKey(1, 0, 0, 1)): os.urandom(100_000), (12, FragmentKey(1, 0, 1, 1)): os.urandom(4097)}
    for (tid, key), data in blobs.items():
        asyncio.run(_client_round_trip(ready["data_addr"], tid, key, data))
    import urllib.request

    with urllib.request.urlopen(f"http://{ready['metrics']}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'tierfs_target_fragments{target="11"} 1.0' in text
    assert 'tierfs_target_events_total{event="writes",target="12"} 1.0' in text
    assert "tierfs_storage_kv_map_version -1.0" in text  # no meta: no map to check KV placement against
    assert "tierfs_storage_kv_lease_seconds 0.0" in text  # and no lease from it
    assert d.stop(signal.SIGKILL) == -signal.SIGKILL

    # restarted (same data dir, ids now from target.json): same identity, same data
    d2 = Daemon(tmp_path, [a for a in args if a not in ("--target-id", "11", "12")])
    daemons.append(d2)
    ready = d2.start()
    assert ready["node_uuid"] == uuid1
    assert ready["targets"] == {str(tmp_path / "t1"): 11, str(tmp_path / "t2"): 12}
    for (tid, key), data in blobs.items():
        assert asyncio.run(_client_read(ready["data_addr"], tid, key)) == data
    # A second daemon on the running node's data_dir (its identity), with
    # targets of its own: refused (until stop 47 it took the node's place).
    res = subprocess.run(
        [sys.executable, "-m", "tierfs.storage.daemon", "--no-meta", "--data-dir", str(tmp_path / "node"),
         "--target", str(tmp_path / "t3"), "--reserved-bytes", "0"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=30)
    assert res.returncode == 2 and f"in use by pid {d2.proc.pid}" in res.stderr, res.stderr  # type: ignore[union-attr]
    assert "Traceback" not in res.stderr
    assert d2.stop() == 0  # SIGTERM: clean exit


@pytest.mark.timeout(90)
def test_sigkill_mid_write_over_the_network(tmp_path: Path, daemons: list[Daemon]) -> None:
    """Clients stream fragments to a node that is SIGKILLed mid-stream:
    every write the client saw acknowledged reads back after a restart."""
    from tierfs.errors import TierFSError
    from tierfs.net import DataClient

    args = ["--no-meta", "--data-dir", str(tmp_path / "node"), "--target", str(tmp_path / "t"),
            "--target-id", "31", "--reserved-bytes", "0", "--transport", "tcp"]
    d = Daemon(tmp_path, args)
    daemons.append(d)
    ready = d.start()
    assert d.proc is not None
    pid = d.proc.pid

    def blob(i: int) -> bytes:
        return (i.to_bytes(4, "little") * 64_000)[: 50_000 + 37 * i]

    acked: set[int] = set()

    async def stream() -> None:
        c = DataClient(transport="tcp", routes={31: ready["data_addr"]}, request_timeout=10)
        counter = iter(range(1 << 20))

        async def writer() -> None:
            for i in counter:
                try:
                    await c.write(31, FragmentKey(i, 0, 0, 1), blob(i))
                except TierFSError:
                    return  # the node is gone
                acked.add(i)
                if len(acked) == 60:
                    os.kill(pid, signal.SIGKILL)

        try:
            await asyncio.gather(*(writer() for _ in range(8)))
        finally:
            await c.close()

    asyncio.run(stream())
    assert d.stop(signal.SIGKILL) == -signal.SIGKILL
    assert len(acked) >= 60
    d2 = Daemon(tmp_path, args)
    daemons.append(d2)
    ready = d2.start()

    async def check() -> None:
        c = DataClient(transport="tcp", routes={31: ready["data_addr"]})
        try:
            for i in sorted(acked):
                assert await c.read(31, FragmentKey(i, 0, 0, 1)) == blob(i), i
        finally:
            await c.close()

    asyncio.run(check())
    assert d2.stop() == 0


@pytest.mark.timeout(60)
def test_scrubber_quarantines_a_rotten_fragment(tmp_path: Path, daemons: list[Daemon]) -> None:
    from tierfs.storage.engine import fragment_path, header_length

    args = ["--no-meta", "--data-dir", str(tmp_path / "node"), "--target", str(tmp_path / "t"),
            "--target-id", "21", "--reserved-bytes", "0", "--transport", "tcp",
            "--scrub-rate", "1GiB", "--scrub-interval", "0.2"]
    d = Daemon(tmp_path, args)
    daemons.append(d)
    ready = d.start()
    rotten, sound = FragmentKey(5, 0, 0, 1), FragmentKey(5, 1, 0, 1)
    data = os.urandom(80_000)
    for key in (rotten, sound):
        asyncio.run(_client_round_trip(ready["data_addr"], 21, key, data))
    path = fragment_path(tmp_path / "t", rotten)
    with open(path, "r+b") as f:  # bit rot on disk, behind the daemon's back
        f.seek(header_length(len(data)) + 1234)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    deadline = time.monotonic() + 30
    while path.exists():
        assert time.monotonic() < deadline, "the scrubber never found the rotten fragment"
        time.sleep(0.05)
    with pytest.raises(NotFoundError):
        asyncio.run(_client_read(ready["data_addr"], 21, rotten))
    assert asyncio.run(_client_read(ready["data_addr"], 21, sound)) == data
    assert len(list((tmp_path / "t" / "quarantine").iterdir())) == 1
    assert d.stop() == 0


@pytest.mark.timeout(30)
def test_bad_configuration_is_refused(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    res = subprocess.run(
        [sys.executable, "-m", "tierfs.storage.daemon", "--no-meta", "--data-dir", str(tmp_path), "--io-backend", "posix",
         "--queue-depth", "0"],
        capture_output=True, text=True, env=env, timeout=30,
    )
    assert res.returncode == 2 and "queue_depth" in res.stderr
    res = subprocess.run(
        [sys.executable, "-m", "tierfs.storage.daemon", "--no-meta", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=30,
    )
    assert res.returncode == 2 and "target" in res.stderr
    assert not list((tmp_path / "target0" / "frags").iterdir())


@pytest.mark.timeout(120)
def test_registers_heartbeats_and_collects_garbage(tmp_path: Path, daemons: list[Daemon]) -> None:
    from tierfs.meta.client import MetaClient
    from tierfs.proto.v1 import meta_pb2 as pb

    grace = 2.0  # tierfs-meta --gc-grace: the unlinked file's fragment stays this long
    with MetaCluster(tmp_path, n=1, state_machine="meta", gc_grace=grace) as meta:
        meta.wait_leader()
        addr = meta.addresses[0]
        args = ["--data-dir", str(tmp_path / "node"), "--meta", addr, "--reserved-bytes", "0",
                "--heartbeat-interval", "0.2", "--gc-interval", "0.2", "--transport", "tcp"]
        d = Daemon(tmp_path, args)
        daemons.append(d)
        ready = d.start()
        assert ready["node_id"] > 0
        (tid,) = ready["targets"].values()
        assert tid > 0

        async def scenario() -> None:
            async with MetaClient([addr]) as mc:
                cmap = await mc.get_cluster_map()
                node = next(n for n in cmap.nodes if n.node_uuid == ready["node_uuid"])
                assert node.state == pb.NODE_STATE_ONLINE and node.data_addr == ready["data_addr"]
                assert list(node.target_ids) == [tid]

                f = await mc.create("/gc-me", redundancy="replica:1", chunk_size=1 << 20)
                sess = await mc.open_write("/gc-me")
                key = FragmentKey(f.attr.inode, 0, 0, generation(sess.data_version, 0))
                payload = os.urandom(200_000)
                assert f.capability and sess.write_capability
                await _client_round_trip(ready["data_addr"], tid, key, payload, (f.capability, sess.write_capability))
                await mc.commit_write(sess.session_id, len(payload), [pb.ChunkRecord(
                    index=0, generation=key.version, length=len(payload), crc32c=crc32c(payload))])

                async def used() -> int:
                    cm = await mc.get_cluster_map()
                    return next(t.used for t in cm.targets if t.target_id == tid)

                deadline = time.monotonic() + 20
                while await used() < len(payload):  # the heartbeat carries the new usage
                    assert time.monotonic() < deadline, "heartbeat never reported the fragment"
                    await asyncio.sleep(0.1)

                t0 = time.monotonic()
                await mc.unlink("/gc-me")
                deadline = time.monotonic() + 30
                while True:
                    try:
                        # a read capability outlives the unlink (it expires; docs/security-caps.md)
                        await _client_read(ready["data_addr"], tid, key, (f.capability,))
                    except NotFoundError:
                        break
                    assert time.monotonic() < deadline, "GC never deleted the fragment"
                    await asyncio.sleep(0.1)
                assert time.monotonic() - t0 >= grace, "GC deleted the fragment before the grace was over"
                while await mc.list_gc([tid]):  # acked: the queue drains
                    assert time.monotonic() < deadline, "GC items never acknowledged"
                    await asyncio.sleep(0.1)

        asyncio.run(scenario())
        # A copy of its data_dir (a cloned disk or image) on another host (a
        # UTS namespace with another hostname): refused while the node
        # heartbeats (until stop 47 it took the node's place in the map, and
        # its groups rebuilt onto the copy's target).
        clone = tmp_path / "clone"
        clone.mkdir()
        (clone / "node.uuid").write_bytes((tmp_path / "node" / "node.uuid").read_bytes())
        log = tmp_path / "clone.log"
        with open(log, "w") as out:
            imp = subprocess.Popen(
                ["unshare", "--uts", "sh", "-c", 'hostname clone-host && exec "$@"', "sh", sys.executable, "-m",
                 "tierfs.storage.daemon", "--data-dir", str(clone), *args[2:]],
                stdout=subprocess.DEVNULL, stderr=out, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=str(REPO))
        try:
            deadline = time.monotonic() + 30
            while "two daemons with one data_dir" not in log.read_text(errors="replace"):
                assert imp.poll() is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.1)
        finally:
            imp.kill()
            imp.wait(10)

        async def unchanged() -> None:
            async with MetaClient([addr]) as mc:
                cmap = await mc.get_cluster_map()
                node = next(n for n in cmap.nodes if n.node_uuid == ready["node_uuid"])
                assert node.data_addr == ready["data_addr"] and list(node.target_ids) == [tid]
                assert next(t.state for t in cmap.targets if t.target_id == tid) == pb.TARGET_STATE_ONLINE

        asyncio.run(unchanged())
        # the node keeps its id across a restart
        assert d.stop() == 0
        d2 = Daemon(tmp_path, args)
        daemons.append(d2)
        again = d2.start()
        assert (again["node_id"], again["targets"]) == (ready["node_id"], ready["targets"])
        assert d2.stop() == 0


@pytest.mark.timeout(90)
def test_waits_for_meta_that_starts_late(tmp_path: Path, daemons: list[Daemon]) -> None:
    with MetaCluster(tmp_path, n=1, state_machine="meta", start=False) as meta:
        args = ["--data-dir", str(tmp_path / "node"), "--meta", meta.addresses[0], "--reserved-bytes", "0",
                "--transport", "tcp"]
        d = Daemon(tmp_path, args)
        daemons.append(d)
        d.spawn()  # meta is not there yet: the node keeps retrying registration
        assert d.proc is not None
        deadline = time.monotonic() + 30
        while "registering with meta failed" not in (tmp_path / "storage.log").read_text():
            assert d.proc.poll() is None, "the node gave up instead of retrying"
            assert time.monotonic() < deadline, "no registration attempt logged"
            time.sleep(0.05)
        meta.start(0)
        ready = d.wait_ready(timeout=60)
        assert ready["node_id"] > 0 and all(t > 0 for t in ready["targets"].values())
        assert d.stop() == 0
