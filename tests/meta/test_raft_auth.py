"""The Raft port against hostile local peers (docs/raft.md, "Authenticated
frames"), with real replica processes.

pysyncobj unpickles every frame it receives; these tests send the frame an
attacker would (a pickle whose ``__reduce__`` creates a marker directory)
and check that a replica holding a cluster secret drops it unread, stays up
and keeps its cluster; that a replica started with another secret cannot
take part; and, as the control that proves the frame is a working exploit,
that a replica run with ``--insecure-no-cluster-secret`` does execute it.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import REPO, MetaCluster, meta_cluster_from_env, wait_for
from tierfs.errors import ConfigError
from tierfs.meta.config import MetaConfig
from tierfs.meta.secret import ensure_secret_file, load_secret
from tierfs.security import admin_token


class _Exploit:
    """Unpickling this calls ``os.mkdir(path)`` in the unpickling process."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (self.path,)


def _frame(obj: object) -> bytes:
    """One pysyncobj frame as its TcpConnection writes it (no password)."""
    data = zlib.compress(pickle.dumps(obj, protocol=2), 3)
    return struct.pack("i", len(data)) + data


def _send_and_wait_close(raft_addr: str, payload: bytes, timeout: float = 10.0) -> bool:
    """Send ``payload`` to a Raft port; True if the replica closed the connection."""
    host, port = raft_addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(payload)
        s.settimeout(timeout)
        try:
            while s.recv(4096):
                pass
        except TimeoutError:
            return False
        except ConnectionResetError:
            pass
    return True


def _local_only() -> None:
    if meta_cluster_from_env() is not None:
        pytest.skip("starts its own replicas")


@pytest.mark.timeout(120)
def test_crafted_pickle_frame_is_not_executed_and_the_replica_stays_in_the_cluster(tmp_path: Path) -> None:
    _local_only()
    with MetaCluster(tmp_path, n=3) as c:
        c.wait_leader()
        c.put("before", "1")
        markers = []
        for i, r in enumerate(c.replicas):  # the leader and both followers
            marker = tmp_path / f"pwned-{i}"
            markers.append(marker)
            # as the first frame of a connection (where the handshake is read)...
            assert _send_and_wait_close(r.raft_addr, _frame(_Exploit(marker)))
            # ... and after a frame that looks like a Fernet token
            fake = b"gAAAAA" + b"A" * 100
            assert _send_and_wait_close(r.raft_addr, struct.pack("i", len(fake)) + fake + _frame(_Exploit(marker)))
        for m in markers:
            assert not m.exists(), f"{m.name}: the pickle ran in a replica"
        assert all(r.alive for r in c.replicas)
        # still one cluster of three, and it commits
        c.put("after", "2")
        c.wait_converged(30)
        for i in range(3):
            st = c.status(i)
            assert len(st.members) == 3, st
            assert c.get_many(["before", "after"], i=i, stale=True) == {"before": "1", "after": "2"}
            assert "not sealed with this cluster's secret" in c.log(i)


def _impersonate(raft_addr: str, payload: bytes, seconds: float) -> int:
    """Listen on a (dead) replica's Raft address and send ``payload`` to every
    replica that connects out to it; returns how many did."""
    host, port = raft_addr.rsplit(":", 1)
    conns: list[socket.socket] = []
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, int(port)))
        srv.listen(8)
        srv.settimeout(0.2)
        deadline = time.monotonic() + seconds
        try:
            while time.monotonic() < deadline:
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                # kept open: pysyncobj discards what it read on a connection
                # that is already closed when it gets to parse it
                conns.append(conn)
                conn.sendall(payload)
        finally:
            for conn in conns:
                conn.close()
    return len(conns)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sealed", [True, False], ids=["secret", "insecure-control"])
def test_process_posing_as_a_dead_replica_cannot_run_code_in_those_that_connect_to_it(
        tmp_path: Path, sealed: bool) -> None:
    """pysyncobj connects out to peers with a lower address: whoever takes a
    dead replica's port gets connections from the others, and answers them."""
    _local_only()
    marker = tmp_path / "pwned"
    with MetaCluster(tmp_path, n=3, cluster_secret=sealed) as c:
        c.wait_leader()
        victim = min(range(3), key=lambda i: c.replicas[i].raft_addr)  # both others dial it
        c.kill(victim)
        served = _impersonate(c.replicas[victim].raft_addr, _frame(_Exploit(marker)), 3.0)
        assert served >= 2, "the replicas did not connect to the impostor"
        if not sealed:
            assert marker.exists()  # the control: this is a working exploit
            return
        assert not marker.exists(), "the pickle ran in a replica"
        others = [i for i in range(3) if i != victim]
        assert all(c.replicas[i].alive for i in others)
        c.put("k", "v")
        c.start(victim)  # the real one comes back and catches up
        c.wait_converged(30)


@pytest.mark.timeout(120)
def test_replica_with_another_secret_cannot_join(tmp_path: Path) -> None:
    _local_only()
    other = ensure_secret_file(tmp_path / "other.secret")
    assert load_secret(other) != load_secret(ensure_secret_file(tmp_path / "cluster.secret"))
    c = MetaCluster(tmp_path, n=3, start=False)
    with c:
        c.replicas[2].extra_args = ["--cluster-secret-file", str(other)]
        c.replicas[2].token = admin_token(load_secret(other))  # its admin token is another one too
        for i in range(3):
            c.start(i)
        leader = c.wait_leader()
        assert leader != 2
        for k in range(20):
            c.put(f"k{k}", "v")
        # the outsider stays outside: it never learns a leader or an entry
        # (the two others commit with their majority of two)
        # (whichever side of a connection receives the first frame refuses it)
        wait_for(lambda: all("not sealed with this cluster's secret" in c.log(2) + c.log(i) for i in (0, 1)),
                 20, "the outsider's connections being refused")
        st = c.status(2)
        # (index 1 is the empty entry every pysyncobj log starts with)
        assert st.role != "leader" and st.leader == "" and st.commit_index <= 1 and st.raft.log_len == 1, st
        assert c.get_many(["k0", "k19"], i=2, stale=True) == {"k0": None, "k19": None}
        # nor can it disturb them: pysyncobj campaigns only once a connection
        # to a peer is up, and none ever is (no vote request, term still 0)
        assert st.term == 0 and c.status(2).term == 0, st
        # control: the same replica with the cluster's secret catches up
        c.stop(2)
        c.replicas[2].extra_args = []
        c.replicas[2].token = None
        c.start(2)
        c.wait_converged(30)
        assert c.get_many(["k0", "k19"], i=2, stale=True) == {"k0": "v", "k19": "v"}


@pytest.mark.timeout(60)
def test_insecure_mode_executes_the_frame_control(tmp_path: Path) -> None:
    """The hole the secret closes, shown on a replica run without one (so
    the test above would fail if the frame were not a working exploit)."""
    _local_only()
    marker = tmp_path / "pwned"
    with MetaCluster(tmp_path, n=1, cluster_secret=False) as c:
        c.wait_leader()
        _send_and_wait_close(c.replicas[0].raft_addr, _frame(_Exploit(marker)), timeout=3)
        wait_for(marker.exists, 10, "the pickle to run in the insecure replica")
        assert "WITHOUT a cluster secret" in c.log(0)


def test_daemon_refuses_to_start_without_a_secret(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERFS_META_")}
    env["PYTHONPATH"] = str(REPO)
    res = subprocess.run([sys.executable, "-m", "tierfs.meta.daemon", "--data-dir", str(tmp_path / "d")],
                         capture_output=True, env=env, cwd=REPO, timeout=60, check=False)
    assert res.returncode == 2, res.stderr
    assert b"cluster secret is required" in res.stderr and b"--insecure-no-cluster-secret" in res.stderr
    assert not (tmp_path / "d").exists()  # refused before anything was created


def test_secret_file_rules(tmp_path: Path) -> None:
    p = ensure_secret_file(tmp_path / "s")
    assert p.stat().st_mode & 0o777 == 0o600
    secret = load_secret(p)
    assert len(secret) == 64 and ensure_secret_file(p) == p and load_secret(p) == secret  # kept
    cfg = MetaConfig(cluster_secret_file=str(p))
    assert cfg.cluster_secret() == secret
    assert MetaConfig(insecure_no_cluster_secret=True).cluster_secret() is None
    bad: list[tuple[MetaConfig, str]] = [
        (MetaConfig(), "is required"),
        (MetaConfig(cluster_secret_file=str(p), insecure_no_cluster_secret=True), "not both"),
        (MetaConfig(cluster_secret_file=str(tmp_path / "missing")), "not found"),
    ]
    short = tmp_path / "short"
    short.write_text("abc\n")
    short.chmod(0o600)
    bad.append((MetaConfig(cluster_secret_file=str(short)), "at least 32"))
    loose = tmp_path / "loose"
    loose.write_text("x" * 64)
    loose.chmod(0o604)
    bad.append((MetaConfig(cluster_secret_file=str(loose)), "other users"))
    for cfg, msg in bad:
        with pytest.raises(ConfigError, match=msg) as ei:
            cfg.cluster_secret()
        assert ei.value.field == "cluster_secret_file"


def test_frame_sealer_opens_only_its_own_untampered_frames() -> None:
    from cryptography.exceptions import InvalidTag

    from tierfs.meta.raft import FrameSealer

    a, b = FrameSealer(b"a" * 64), FrameSealer(b"b" * 64)
    data = zlib.compress(pickle.dumps({"type": "append_entries", "term": 1}))
    tok = a.encrypt_at_time(data, 1234)
    assert a.extract_timestamp(tok) == 1234 and a.decrypt(tok) == data
    assert FrameSealer(b"a" * 64).decrypt(tok) == data  # another replica, same secret
    assert a.encrypt_at_time(data, 1234) != tok  # fresh nonce every frame
    bad = [tok[:-1], b"", b"\x01" * 40, bytes([2]) + tok[1:], _frame(_Exploit(Path("/nonexistent/x")))]
    bad += [tok[:i] + bytes([tok[i] ^ 1]) + tok[i + 1:] for i in (0, 3, 12, 25, len(tok) - 1)]
    for t in bad:
        with pytest.raises(InvalidTag):
            a.extract_timestamp(t)
    with pytest.raises(InvalidTag):
        b.extract_timestamp(tok)
    assert a.refused == len(bad) and b.refused == 1
