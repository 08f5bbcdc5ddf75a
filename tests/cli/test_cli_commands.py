"""The ``tierfs`` CLI against a real local cluster (3 meta + 6 storage
processes started by ``tierfs up``'s function): in-process calls of the
command functions and of ``run`` (exit codes, messages, ``--json``), and a
few real ``tierfs`` subprocesses."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierfs.cli import cluster_down, cluster_status, cluster_up, fs, resolve_meta, run
from tierfs.cli.main import render_status
from tierfs.client import AsyncClient
from tierfs.errors import ConfigError
from tierfs.local import LocalCluster

CLI = [sys.executable, "-m", "tierfs.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TIERFS_META"}
    env.update(extra)
    return env


def _cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env or _env())


class Run:
    """``run(argv)`` in-process, with captured output."""

    def __init__(self, meta: str) -> None:
        self.meta = meta

    def __call__(self, *args: str, cluster: bool = True, tty: bool = False,
                 env: dict[str, str] | None = None) -> tuple[int, str, str]:
        out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True)
        err = io.StringIO()
        argv = [*args, "--meta", self.meta] if cluster else list(args)
        env = {"TIERFS_TOKEN": os.environ["TIERFS_TOKEN"]} if env is None else env
        rc = run(argv, stdout=out, stderr=err, env=env, tty=tty)
        out.buffer.seek(0)
        text = out.buffer.read().decode(errors="replace")
        out.close()
        return rc, text, err.getvalue()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    data = tmp_path_factory.mktemp("cli") / "cluster"
    try:
        info = cluster_up(str(data), timeout=90)
        yield info
    finally:
        if (data / "cluster.toml").exists():
            cluster_down(str(data))


@pytest.fixture
def cli(cluster: dict[str, Any]) -> Run:
    return Run(",".join(cluster["meta"]))


# ---- up / status --------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_up_twice_reuses_the_running_cluster(cluster: dict[str, Any]) -> None:
    assert len(cluster["started"]) == 9 and cluster["counts"] == {"meta": 3, "storage": 6, "targets_per_node": 1}
    pids = LocalCluster.open(cluster["data_dir"]).running()
    r = _cli("up", "--data", cluster["data_dir"])
    assert r.returncode == 0, r.stderr
    token = Path(cluster["data_dir"]).resolve() / "admin.token"
    assert r.stdout.strip() == cluster["export"] == (f"export TIERFS_META={','.join(cluster['meta'])}\n"
                                                     f"export TIERFS_TOKEN_FILE={token}")
    # eval'd in a shell elsewhere, with no credential of its own, the lines are enough for the CLI
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERFS_")}
    sh = subprocess.run(["bash", "-c", f'eval "$1" && exec {sys.executable} -m tierfs.cli ls /', "-", r.stdout],
                        env=env, cwd="/", capture_output=True, text=True, timeout=30)
    assert sh.returncode == 0, sh.stderr
    assert "already running" in r.stderr
    again = LocalCluster.open(cluster["data_dir"])
    assert again.running() == pids and all(pids.values())
    # the replicas share the secret made on the first up, and were started with it
    secret = Path(cluster["cluster_secret"])
    assert secret == again.dir / "cluster.secret" and secret.stat().st_mode & 0o777 == 0o600
    meta_log = (again.dir / "logs" / "meta-0.log").read_text()
    assert "WITHOUT a cluster secret" not in meta_log
    cmdline = Path(f"/proc/{again.proc('meta-0').pid}/cmdline").read_bytes().split(b"\0")
    assert f"--cluster-secret-file={secret}".encode() in cmdline


@pytest.mark.timeout(60)
def test_status_json_has_every_daemon_target_and_group(cluster: dict[str, Any]) -> None:
    r = _cli("status", "--json", "--data", cluster["data_dir"])
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    local = LocalCluster.open(cluster["data_dir"])
    pid_of = {p.addr: p.pid for p in local.procs}
    assert st["healthy"] is True
    assert sorted(m["addr"] for m in st["meta"]) == sorted(cluster["meta"])
    assert sorted(m["role"] for m in st["meta"]) == ["follower", "follower", "leader"]
    for m in st["meta"]:
        assert set(m) >= {"id", "addr", "role", "state", "pid"}
        assert m["state"] == "up" and m["pid"] == pid_of[m["addr"]] and m["id"].startswith("meta-")
    assert len(st["storage"]) == 6
    for s in st["storage"]:
        assert set(s) >= {"id", "addr", "data_addr", "state", "pid", "targets"}
        assert s["state"] == "online" and s["pid"] == pid_of[s["data_addr"]]
        assert len(s["targets"]) == 1
        t = s["targets"][0]
        assert set(t) >= {"id", "state", "capacity", "used"} and t["state"] == "online" and t["capacity"] > 0
    assert st["groups"] and all(g["state"] == "healthy" and len(g["targets"]) == g["width"] for g in st["groups"])
    # Without --data nobody knows the pids; the members list finds the other replicas.
    st2 = asyncio.run(cluster_status([cluster["meta"][1]]))
    assert len(st2["meta"]) == 3 and all(m["pid"] is None for m in st2["meta"])
    assert all(s["pid"] is None for s in st2["storage"])
    # and the text has no PID column then (it was a column of dashes)
    heads = [ln.split() for ln in render_status(st2).splitlines() if ln.startswith(("META ", "NODE "))]
    assert heads == [["META", "ADDRESS", "ROLE", "STATE"],
                     ["NODE", "DATA", "ADDRESS", "STATE", "TARGET", "TSTATE", "USED", "CAPACITY", "PATH"]], heads
    heads = [ln.split() for ln in render_status(st).splitlines() if ln.startswith(("META ", "NODE "))]
    assert heads[0][-1] == "PID" and heads[1][4] == "PID", heads


@pytest.mark.timeout(60)
def test_status_names_each_replica_once_when_dialled_by_another_name(cluster: dict[str, Any]) -> None:
    """The replicas named by other addresses than the ones they are members
    by (Kubernetes: TIERFS_META of short names, members by their full DNS
    names; here localhost for 127.0.0.1): each is listed once. Until stop 48
    the members list added every replica again under its member address,
    six rows for three replicas, and the majority the no-leader line asks
    for counted them twice."""
    aliases = [a.replace("127.0.0.1", "localhost") for a in cluster["meta"]]
    assert aliases != cluster["meta"]
    st = asyncio.run(cluster_status(aliases[:1]))
    assert len(st["meta"]) == 3, st["meta"]
    assert sorted(m["role"] for m in st["meta"]) == ["follower", "follower", "leader"]
    assert st["healthy"] is True
    st = asyncio.run(cluster_status(aliases))
    assert sorted(m["addr"] for m in st["meta"]) == sorted(aliases), st["meta"]


# ---- file commands ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_put_get_cat_ls_stat_round_trip(cli: Run, tmp_path: Path) -> None:
    src = tmp_path / "shard.bin"
    payload = os.urandom(9 * (1 << 20) + 12345)  # not a multiple of the 4 MiB chunk
    src.write_bytes(payload)
    assert cli("mkdir", "-p", "/rt/a/b")[0] == 0
    assert cli("mkdir", "-p", "/rt/a/b")[0] == 0  # -p: no error if it exists
    rc, out, err = cli("put", str(src), "/rt/a/", "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["remote"] == "/rt/a/shard.bin" and r["bytes"] == len(payload)
    rc, out, _ = cli("ls", "/rt/a")
    assert rc == 0 and out.split() == ["b/", "shard.bin"]  # no temporary name left behind
    rc, out, _ = cli("ls", "-l", "/rt/a")
    assert rc == 0 and str(len(payload)) in out and "-rw-r--r--" in out
    rc, out, _ = cli("stat", "/rt/a/shard.bin", "--json")
    st = json.loads(out)
    assert st["size"] == len(payload) and st["type"] == "file" and st["chunks"] == 3
    assert st["layout"]["redundancy"] == "ec:4+2" and st["layout"]["chunk_size"] == 4 << 20
    for slashed in ("//rt//a/shard.bin", "///rt/a//shard.bin"):  # one slash, as POSIX reads them
        rc, out, err = cli("stat", slashed, "--json")
        assert rc == 0, err
        assert json.loads(out)["inode"] == st["inode"] and json.loads(out)["chunks"] == 3
    dst = tmp_path / "back.bin"
    rc, out, err = cli("get", "/rt/a/shard.bin", str(dst))
    assert rc == 0, err
    assert dst.read_bytes() == payload and ("MB/s" in out or "kB/s" in out), out
    assert not (tmp_path / "back.bin.part").exists()
    catted = subprocess.run([*CLI, "cat", "/rt/a/shard.bin", "--meta", cli.meta], capture_output=True,
                            timeout=60, env=_env())
    assert catted.returncode == 0 and catted.stdout == payload
    piped = subprocess.run([*CLI, "put", "-", "/rt/stdin.bin", "--meta", cli.meta], input=payload[:3_000_001],
                           capture_output=True, timeout=60, env=_env())
    assert piped.returncode == 0, piped.stderr
    got = subprocess.run([*CLI, "get", "/rt/stdin.bin", "-", "--meta", cli.meta], capture_output=True,
                         timeout=60, env=_env())
    assert got.returncode == 0 and got.stdout == payload[:3_000_001]


@pytest.mark.timeout(60)
def test_put_replaces_atomically_and_reports_progress(cluster: dict[str, Any], tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"A" * 5_000_000)
    b.write_bytes(b"B" * 7_000_001)
    seen: list[tuple[int, int | None]] = []

    async def go() -> bytes:
        async with AsyncClient(cluster["meta"]) as c:
            await c.mkdir("/atomic", exist_ok=True)
            await fs.put(c, str(a), "/atomic/f")
            await fs.put(c, str(b), "/atomic/f", progress=lambda d, t: seen.append((d, t)))
            assert await c.ls("/atomic") == ["f"]
            return await c.read_bytes("/atomic/f")

    assert asyncio.run(go()) == b.read_bytes()
    assert seen[0] == (0, 7_000_001) and seen[-1] == (7_000_001, 7_000_001)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


@pytest.mark.timeout(60)
def test_mv_rm_and_set_layout(cli: Run, tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_bytes(os.urandom(300_000))
    assert cli("mkdir", "-p", "/ops/d1")[0] == 0
    assert cli("mkdir", "/ops/d2")[0] == 0
    rc, _, err = cli("mkdir", "/")  # as mkdir(1): it exists ("the root directory has no name" until stop 44)
    assert rc == 1 and "always exists" in err, err
    assert cli("mkdir", "-p", "/")[0] == 0
    assert cli("put", str(f), "/ops/d1/x")[0] == 0
    assert cli("mv", "/ops/d1/x", "/ops/d2")[0] == 0  # into a directory, as mv(1)
    assert cli("ls", "/ops/d2")[1].split() == ["x"] and cli("ls", "/ops/d1")[1].split() == []
    # several paths (each under its name; a missing one is an error, the others listed) and ls -la
    rc, out, err = cli("ls", "-la", "/ops/d2", "/ops/nope", "/ops")
    assert rc == 1 and "/ops/nope" in err, (out, err)
    assert out.startswith("/ops/d2:\nMODE") and "\n\n/ops:\n" in out and "d1/" in out, out
    rc, out, err = cli("set-layout", "/ops/d1", "--redundancy", "replica:3", "--chunk-size", "1MiB")
    assert rc == 0 and "replica:3" in out and "warning" not in out, err
    # wider than the cluster: legal (nodes may join), and said at once
    assert cli("mkdir", "/ops/wide")[0] == 0
    rc, out, err = cli("set-layout", "/ops/wide", "--redundancy", "ec:9+9")
    assert rc == 0 and "warning: ec:9+9 places 18 fragments on distinct storage nodes" in out, (out, err)
    assert cli("put", str(f), "/ops/d1/r")[0] == 0
    st = json.loads(cli("stat", "/ops/d1/r", "--json")[1])
    assert st["layout"]["redundancy"] == "replica:3" and st["layout"]["chunk_size"] == 1 << 20
    back = tmp_path / "r"
    assert cli("get", "/ops/d1/r", str(back))[0] == 0 and back.read_bytes() == f.read_bytes()
    rc, _, err = cli("rm", "/ops")
    assert rc == 1 and "not empty" in err and "rm -r" in err
    assert cli("rm", "/ops/d2/x")[0] == 0
    assert cli("rm", "-r", "/ops")[0] == 0
    rc, _, err = cli("ls", "/ops")
    assert rc == 1 and "/ops" in err and "no such file" in err


# ---- errors ----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_expected_errors_are_one_line_and_exit_1(cli: Run, tmp_path: Path) -> None:
    rc, out, err = cli("stat", "/ckpt/step-10")
    assert rc == 1 and err.startswith("tierfs: ") and "no such file" in err and "/ckpt" in err
    assert "Traceback" not in err
    rc, out, err = cli("get", "/ckpt/step-10", str(tmp_path / "x"), "--json")
    assert rc == 1 and json.loads(out)["error"]["code"] == "ERROR_CODE_NOT_FOUND"
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.part").exists()
    rc, _, err = cli("put", str(tmp_path / "missing"), "/nope")
    assert rc == 1 and "cannot read local file" in err and "missing" in err
    assert cli("stat", "/nope")[0] == 1  # a failed put creates nothing
    (tmp_path / "present").write_bytes(b"x")
    for dest in ("/nodir/", "/nodir/f"):  # as cp: no directory is made, and the error says how to make it
        rc, _, err = cli("put", str(tmp_path / "present"), dest)
        assert rc == 1 and "/nodir: no such directory" in err and "tierfs mkdir -p /nodir" in err, err
    assert cli("stat", "/nodir")[0] == 1
    rc, _, err = cli("mkdir", "/nodir/sub")
    assert rc == 1 and "mkdir -p makes the missing parents too" in err, err


def test_mkdir_and_rm_take_several_paths_and_go_on_past_a_failure(cli: Run) -> None:
    assert cli("mkdir", "-p", "/many/a", "/many/b/c", "/many/d") == (0, "", "")
    rc, out, _ = cli("ls", "/many")
    assert rc == 0 and out.split() == ["a/", "b/", "d/"]
    rc, out, err = cli("mkdir", "/many/e", "/many/a", "/many/f")  # /many/a exists: the others are made
    assert rc == 1 and err.count("tierfs: ") == 1 and "/many/a" in err, err
    assert cli("ls", "/many")[1].split() == ["a/", "b/", "d/", "e/", "f/"]
    rc, out, err = cli("rm", "/many/a", "/many/b", "/many/d", "--json")  # /many/b is not empty
    r = json.loads(out)
    assert rc == 1 and [x["path"] for x in r["results"]] == ["/many/a", "/many/d"], out
    assert [e["path"] for e in r["errors"]] == ["/many/b"] and "rm -r" in err, err
    assert cli("rm", "-r", "/many/b", "/many/e", "/many/f") == (0, "", "")
    assert cli("ls", "/many")[1].split() == []
    rc, _, err = cli("set-layout", "/", "--redundancy", "ec:4")
    assert rc == 1 and "ec:K+M" in err and "Traceback" not in err
    rc, _, err = cli("set-layout", "/", "--chunk-size", "3MiB")
    assert rc == 2 and "power of two" in err
    rc, _, err = cli("set-layout", "/", "--chunk-size", "4M")  # 4,000,000 bytes: the usage error says so
    assert rc == 2 and "4,000,000 bytes" in err and "did you mean 4MiB?" in err, err
    rc, _, err = cli("set-layout", "/", "--chunk-size", "128MiB")  # a power of two meta refuses
    assert rc == 1 and "power of two between" in err, err
    rc, _, err = cli("rm", "-r", "/")
    assert rc == 1 and "root directory" in err
    rc, _, err = cli("frobnicate")
    assert rc == 2 and "invalid choice" in err
    rc, out, err = cli("chmod", "999", "/", "--json")  # under --json a usage error too is an error object
    assert rc == 2 and json.loads(out)["error"]["code"] == "USAGE" and "999" in json.loads(out)["error"]["message"], out
    rc, _, err = cli("set-layout", "/")
    assert rc == 2 and "--redundancy" in err
    for opt in ("--chunk-size", "--stripe"):  # 0 read as "not given"
        rc, _, err = cli("set-layout", "/", opt, "0")
        assert rc == 2 and f"{opt} must be" in err and "not 0" in err, err
    rc, _, err = cli("put", "-", "/", cluster=True)
    assert rc == 1 and "standard input" in err


@pytest.mark.timeout(120)
def test_a_cluster_without_a_meta_leader_says_so(tmp_path: Path) -> None:
    """Two of three meta replicas down: `tierfs ls` says the one that
    answers knows no leader. Until stop 49 it gave the last refused
    connection and asked "is the cluster running?"."""
    cl = LocalCluster(tmp_path / "c", n_meta=3, n_storage=1)
    cl.up(timeout=90)
    try:
        survivor = cl.meta_addrs[0]
        for name in ("meta-1", "meta-2"):
            cl.kill(name)
        r = _cli("ls", "/", "--meta", ",".join(cl.meta_addrs), "--token-file", str(cl.dir / "admin.token"),
                 "--timeout", "4", cwd=tmp_path)
        assert r.returncode == 1, r
        assert f"no meta leader: {survivor} answers, but knows no leader that answers" in r.stderr, r.stderr
        assert "is the cluster running" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        cl.stop()


@pytest.mark.timeout(60)
def test_unreachable_cluster_and_no_address(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        r = _cli("ls", "/", "--meta", f"127.0.0.1:{port}", "--timeout", "2", cwd=tmp_path)
    assert r.returncode == 1
    assert f"cluster unreachable: tried 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr
    r = _cli("status", "--meta", f"127.0.0.1:{port}", "--timeout", "2", cwd=tmp_path)
    assert r.returncode == 1 and "cluster unreachable" in r.stderr and "Traceback" not in r.stderr
    r = _cli("ls", "/", cwd=tmp_path)  # no --meta, no TIERFS_META, no ./.tierfs here
    assert r.returncode == 1 and "TIERFS_META" in r.stderr and "Traceback" not in r.stderr
    r = _cli("down", "--data", str(tmp_path / "nothing"), cwd=tmp_path)
    assert r.returncode == 1 and "no local cluster" in r.stderr


@pytest.mark.timeout(60)
def test_up_with_other_counts_and_bad_counts(tmp_path: Path) -> None:
    data = tmp_path / "small"
    # bad counts are usage errors (exit 2; exit 1 until stop 44), and nothing is made
    rc, out, err = Run("")("up", "--data", str(data), "--meta", "2", cluster=False)
    assert rc == 2 and "odd" in err and not data.exists()
    for n in ("0", "-1", "100000"):  # 0 started the default 6; 100000 ran out of file descriptors
        rc, out, err = Run("")("up", "--data", str(data), "--storage", n, cluster=False)
        assert rc == 2 and "storage" in err and "between 1 and 256" in err and not data.exists(), err
    rc, out, err = Run("")("up", "--data", str(data), "--targets-per-node", "0", cluster=False)
    assert rc == 2 and "targets-per-node" in err and not data.exists(), err
    rc, out, err = Run("127.0.0.1:1")("node", "label", "1", cluster=False)  # no --rack: refused before any call
    assert rc == 2 and "--rack R is required" in err, err
    rc, out, err = Run("127.0.0.1:1")("node", "label", "1", "--rack", "a\nb", cluster=False)
    assert rc == 2 and "no control characters" in err, err
    try:
        # A shell that exported an earlier cluster's lines, whose directory
        # is gone (or not made yet): up makes it (it used to fail: "token
        # file not found"), and down too needs no credential.
        gone = {"TIERFS_TOKEN_FILE": str(data / "admin.token")}
        rc, out, err = Run("")("up", "--data", str(data), "--meta", "1", "--storage", "1", "--json", cluster=False,
                               env=gone)
        assert rc == 0, err
        info = json.loads(out)
        assert info["counts"] == {"meta": 1, "storage": 1, "targets_per_node": 1} and len(info["started"]) == 2
        rc, out, err = Run("")("up", "--data", str(data), cluster=False)  # default counts: the plan wins
        assert rc == 0 and "reused as planned" in err and "already running" in err
        assert "note: new files under / get ec:4+2, which needs 6 storage nodes; with 1" in err, err
        # once / has a layout that fits, no note (until stop 49 it named ec:4+2 whatever / had)
        rc, out, err = Run("")("set-layout", "/", "--redundancy", "replica:1", "--data", str(data), cluster=False)
        assert rc == 0, err
        rc, out, err = Run("")("up", "--data", str(data), cluster=False)
        assert rc == 0 and "note: new files" not in err, err
    finally:
        rc, out, err = Run("")("down", "--data", str(data), cluster=False, env={"TIERFS_TOKEN_FILE": "/nonexistent"})
    assert rc == 0 and "stopped 2 daemons" in out, err


@pytest.mark.timeout(120)
def test_up_warns_when_the_targets_are_read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk too full for the targets' free-space floor: `up` said "every
    daemon up" and exit 0 while every write would fail (until stop 48). The
    daemons take min_free from the environment here (99% of the disk)."""
    data = tmp_path / "full"
    monkeypatch.setenv("TIERFS_STORAGE_MIN_FREE", "99%")
    try:
        rc, out, err = Run("")("up", "--data", str(data), "--meta", "1", "--storage", "2", cluster=False)
        assert rc == 0, err
        assert "warning: 2 of 2 storage targets are read-only" in err and "Every write will fail" in err, err
        assert str(data / "storage-0" / "t0") in err, err
        rc, out, err = Run("")("up", "--data", str(data), "--json", cluster=False)
        assert rc == 0 and len(json.loads(out)["read_only_targets"]) == 2, (out, err)
    finally:
        rc, out, err = Run("")("down", "--data", str(data), cluster=False)
    assert rc == 0, err
    monkeypatch.delenv("TIERFS_STORAGE_MIN_FREE")
    rc, out, err = Run("")("up", "--data", str(data), cluster=False)  # the same cluster, room enough now
    try:
        assert rc == 0 and "read-only" not in err, err
    finally:
        Run("")("down", "--data", str(data), cluster=False)


def test_resolve_meta_precedence(tmp_path: Path) -> None:
    (tmp_path / "cluster.toml").write_text('[cluster]\nmeta = ["127.0.0.1:3"]\n')
    env = {"TIERFS_META": "127.0.0.1:2, 127.0.0.1:22"}
    assert resolve_meta("127.0.0.1:1", str(tmp_path), env) == ["127.0.0.1:1"]
    assert resolve_meta(None, str(tmp_path), env) == ["127.0.0.1:2", "127.0.0.1:22"]
    assert resolve_meta(None, str(tmp_path), {}) == ["127.0.0.1:3"]
    with pytest.raises(ConfigError, match="HOST:PORT"):
        resolve_meta("localhost", None, {})
    with pytest.raises(ConfigError, match="no local cluster"):
        resolve_meta(None, str(tmp_path / "none"), {})


# ---- degraded, down, up again -----------------------------------------------------------


@pytest.mark.timeout(120)
def test_status_degraded_then_down_then_up_keeps_data(cluster: dict[str, Any], cli: Run, tmp_path: Path) -> None:
    data = cluster["data_dir"]
    payload = os.urandom(6 << 20)
    (tmp_path / "keep").write_bytes(payload)
    assert cli("put", str(tmp_path / "keep"), "/keep.bin")[0] == 0
    cl = LocalCluster.open(data)
    victim = cl.proc("storage-3")
    cl.kill("storage-3")
    rc, out, _ = Run(cli.meta)("status", "--json", "--data", data, cluster=False)
    assert rc == 3  # degraded
    st = json.loads(out)
    assert st["healthy"] is False
    down = [s for s in st["storage"] if s["data_addr"] == victim.addr]
    assert down and down[0]["state"] == "down"
    # A degraded read still returns the right bytes.
    back = tmp_path / "back"
    assert cli("get", "/keep.bin", str(back))[0] == 0 and back.read_bytes() == payload
    # `up` restarts what is missing and only that.
    r = _cli("up", "--data", data)
    assert r.returncode == 0, r.stderr
    assert "started 1 daemon (" in r.stderr
    # `down` stops every daemon...
    procs = LocalCluster.open(data).procs
    r = _cli("down", "--data", data)
    assert r.returncode == 0 and "stopped 9 daemons" in r.stdout, r.stderr
    assert not any(p.alive() for p in procs)
    assert not any(LocalCluster.open(data).running().values())
    r = _cli("status", "--data", data, "--timeout", "2")
    assert r.returncode == 1 and "is not running" in r.stderr and "tierfs up --data" in r.stderr
    # ... and `up` brings the same cluster back with its data.
    r = _cli("up", "--data", data, "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["reused"] is True and len(info["started"]) == 9 and info["meta"] == cluster["meta"]
    back.unlink()
    assert cli("get", "/keep.bin", str(back))[0] == 0 and back.read_bytes() == payload


def test_kv_lease_line_reads_the_leaders_view() -> None:
    from tierfs.cli.main import kv_lease_line

    def node(i: int, leased: bool = True, applied: int = 12, stalled: bool = False) -> dict[str, Any]:
        return {"node_id": i, "leased": leased, "applied_map_version": applied, "granted_ms_ago": 100,
                "stalled": stalled}

    ok = {"map_version": 12, "published": 12, "nodes": [node(1), node(2)], "stalled": [], "online_nodes": 2}
    assert kv_lease_line(ok) == ("kv leases: 2 of 2 online storage nodes leased; map version 12 in effect on every "
                                 "leased node")
    moving = {**ok, "published": 11}
    assert kv_lease_line(moving).endswith("map version 12 taking effect (version 11 in effect on every leased node)")
    # Right after a failover the new leader has heard from some nodes only.
    new = {**ok, "published": 0, "nodes": [node(1)], "online_nodes": 6}
    assert kv_lease_line(new) == ("kv leases: 1 of 6 online storage nodes leased; map version 12 taking effect "
                                  "(a new leader waits for every node to report, up to one lease)")
    stuck = {**ok, "nodes": [node(1), node(2, leased=False, applied=9, stalled=True)], "stalled": [2]}
    assert kv_lease_line(stuck) == ("kv leases: node(s) [2] hold no KV map lease (their KV gets miss and puts are "
                                    "refused); they report map version(s) [9] applied, meta is at 12: see their logs")


# ---- get's local target, temporary names, bad options and paths ----------------------------


@pytest.mark.timeout(60)
def test_get_writes_into_a_fifo_and_through_a_symlink(cli: Run, tmp_path: Path) -> None:
    import stat

    payload = os.urandom(20_000)  # fits a pipe's buffer: read after get returns
    (tmp_path / "src").write_bytes(payload)
    assert cli("put", str(tmp_path / "src"), "/gettarget.bin")[0] == 0
    # A fifo (as /dev/null, a device) is written into, not replaced by a regular file.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        rc, _, err = cli("get", "/gettarget.bin", str(fifo), "--json")
        assert rc == 0, err
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the fifo was replaced"
        assert os.read(reader, 100_000) == payload
    finally:
        os.close(reader)
    # A symbolic link to a regular file: the target gets the bytes, the link stays.
    target = tmp_path / "real.bin"
    target.write_bytes(b"old")
    link = tmp_path / "link.bin"
    link.symlink_to(target.name)
    rc, _, err = cli("get", "/gettarget.bin", str(link))
    assert rc == 0, err
    assert link.is_symlink() and os.readlink(link) == target.name
    assert target.read_bytes() == payload
    # A regular file is replaced whole (temporary file + rename): a hard link keeps the old bytes.
    plain, other = tmp_path / "plain", tmp_path / "plain-hardlink"
    plain.write_bytes(b"old")
    os.link(plain, other)
    assert cli("get", "/gettarget.bin", str(plain))[0] == 0
    assert plain.read_bytes() == payload and other.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.bin", "plain", "plain-hardlink",
                                                          "real.bin", "src"]


@pytest.mark.timeout(60)
def test_get_leaves_an_unrelated_part_file_alone(cli: Run, tmp_path: Path) -> None:
    (tmp_path / "src").write_bytes(b"remote bytes")
    assert cli("put", str(tmp_path / "src"), "/partcheck.bin")[0] == 0
    (tmp_path / "src").unlink()
    notes = tmp_path / "notes.part"
    notes.write_bytes(b"precious\n")
    rc, _, err = cli("get", "/nonexist", str(tmp_path / "notes"))
    assert rc == 1 and "no such file" in err, err
    assert notes.read_bytes() == b"precious\n"
    rc, _, err = cli("get", "/partcheck.bin", str(tmp_path / "notes"))
    assert rc == 0, err
    assert (tmp_path / "notes").read_bytes() == b"remote bytes" and notes.read_bytes() == b"precious\n"
    rc, _, err = cli("get", "/partcheck.bin", str(tmp_path / "nodir" / "notes"))
    assert rc == 1 and "cannot write local file" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "notes.part"]  # no temporary file left


@pytest.mark.timeout(90)
def test_put_and_get_names_at_the_255_byte_limit(cli: Run, tmp_path: Path) -> None:
    names = ["c" * 255, "é" * 127 + "c", "€" * 85]  # 255 bytes each; the second and third cut inside characters
    assert all(len(n.encode()) == 255 for n in names)
    src = tmp_path / "src"
    src.mkdir()
    assert cli("mkdir", "/longnames")[0] == 0
    dst = tmp_path / "back"
    dst.mkdir()
    for i, n in enumerate(names):
        (src / "one.bin").write_bytes(b"%d" % i * 1000)
        rc, _, err = cli("put", str(src / "one.bin"), f"/longnames/{n}")
        assert rc == 0, err
        rc, _, err = cli("get", f"/longnames/{n}", str(dst))
        assert rc == 0, err
        assert (dst / n).read_bytes() == b"%d" % i * 1000
        (src / n).write_bytes(b"tree %d" % i)
    (src / "one.bin").unlink()
    rc, out, err = cli("ls", "/longnames")
    assert rc == 0 and sorted(out.split()) == sorted(names), out  # no temporary name left behind
    rc, _, err = cli("put", "-r", str(src), "/longtree")
    assert rc == 0, err
    rc, _, err = cli("get", "-r", "/longtree", str(tmp_path / "tree"))
    assert rc == 0, err
    assert sorted(p.name for p in (tmp_path / "tree").iterdir()) == sorted(names)
    for i, n in enumerate(names):
        assert (tmp_path / "tree" / n).read_bytes() == b"tree %d" % i


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "-inf", "soon"])
def test_timeout_must_be_a_finite_positive_number(value: str, tmp_path: Path) -> None:
    for argv in (["ls", "/", "--timeout", value], ["--timeout", value, "ls", "/"]):
        rc, _, err = Run("127.0.0.1:1")(*argv)
        assert rc == 2 and "--timeout" in err and "Traceback" not in err, err
    rc, _, err = Run("127.0.0.1:1")("kv", "put", "k", "/dev/null", "--ttl", value)
    assert rc == 2 and "--ttl" in err, err
    rc, _, err = Run("127.0.0.1:1")("mount", str(tmp_path), "--attr-timeout", "nan")
    assert rc == 2 and "--attr-timeout" in err, err


@pytest.mark.timeout(60)
def test_mkdir_of_a_bad_path_changes_nothing(cli: Run) -> None:
    for args in (["-p", "/mk1//y/./z/../w"], ["-p", "/mk1/y/z/.."], ["/mk1/" + "n" * 256], ["-p", "/mk1/a/" + "n" * 256]):
        rc, _, err = cli("mkdir", *args)
        assert rc == 1 and args[-1] in err, err
        assert cli("stat", "/mk1")[0] == 1, f"mkdir {args} made /mk1"
    # Repeated slashes are one, as POSIX has it.
    assert cli("mkdir", "-p", "/mk1//a///b/") == (0, "", "")
    assert cli("mkdir", "/mk1//c") == (0, "", "")
    assert cli("ls", "/mk1")[1].split() == ["a/", "c/"] and cli("ls", "/mk1/a")[1].split() == ["b/"]
    rc, _, err = cli("mkdir", "/mk1//a/./d")
    assert rc == 1 and "/mk1//a/./d" in err and "'.'" in err, err
    assert cli("rm", "-r", "/mk1")[0] == 0


@pytest.mark.timeout(90)
def test_status_without_a_meta_majority_shows_the_replicas(tmp_path: Path) -> None:
    """Two of three meta replicas SIGKILLed: `tierfs status --data` shows
    the replica table (the dead ones named and down) and exits 3, instead
    of "cluster unreachable" with no table (exit 1) until stop 44."""
    data = tmp_path / "nomaj"
    cluster_up(str(data), n_storage=1, timeout=90)
    try:
        cl = LocalCluster.open(str(data))
        for name in ("meta-1", "meta-2"):
            cl.kill(name)
        rc, out, err = Run("")("status", "--data", str(data), "--timeout", "3", cluster=False, env={})
        assert rc == 3, (out, err)
        assert "no meta leader: 1 of 3 replicas answer" in out, out
        rows = [line.split() for line in out.splitlines() if line.startswith("meta-")]
        assert sorted(r[0] for r in rows) == ["meta-0", "meta-1", "meta-2"], rows
        assert sum("down" in r for r in rows) == 2, rows
        rc, out, err = Run("")("status", "--data", str(data), "--timeout", "3", "--json", cluster=False, env={})
        st = json.loads(out)
        assert rc == 3 and st["healthy"] is False and st["no_leader"], st
        assert sorted(m["id"] for m in st["meta"]) == ["meta-0", "meta-1", "meta-2"], st["meta"]
    finally:
        cluster_down(str(data))
