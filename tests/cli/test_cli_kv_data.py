"""``tierfs kv put/get/stat/rm/stats/replay``, KV usage in ``tierfs status``
and the storage daemons' Prometheus KV counters, against a real local
cluster (1 meta replica, 3 storage daemons)."""

from __future__ import annotations

import io
import json
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kv import public_trace_path
from tests.kv.pools import define_pool, pool_served
from tierfs.cli import run
from tierfs.cli.kvdata import render_stats
from tierfs.local import LocalCluster

pytestmark = pytest.mark.timeout(180)


def cli(meta: str, *args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = run([*args, "--meta", meta], stdout=out, stderr=err, env={"TIERFS_TOKEN": os.environ["TIERFS_TOKEN"]}, tty=False)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def cl(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("kvcli"), n_meta=1, n_storage=3,
                     extra_storage_args=["--metrics-addr=127.0.0.1:0"])
    c.up(timeout=120)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def meta(cl: LocalCluster) -> str:
    m = ",".join(cl.meta_addrs)
    end = time.monotonic() + 30
    while cli(m, "kv", "put", "warm-up", "/dev/null")[0] != 0:  # the default pool reaches every daemon
        assert time.monotonic() < end, "default pool never served"
        time.sleep(0.2)
    return m


def test_put_get_stat_rm(meta: str, tmp_path: Path) -> None:
    src = tmp_path / "block.bin"
    src.write_bytes(bytes(range(256)) * 400)
    rc, out, err = cli(meta, "kv", "put", "blk-1", str(src))
    assert rc == 0 and "stored in pool default" in out, err
    rc, out, err = cli(meta, "kv", "put", "blk-1", str(src), "--json")
    assert rc == 0 and json.loads(out)["stored"] is False  # a no-op: already there
    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(b"x")
    rc, out, err = cli(meta, "kv", "put", "blk-1", str(tiny))  # said "blk-1: 1 B already there (kept)"
    assert rc == 0 and "blk-1: already there in pool default, kept (the 1 B given were not stored" in out, out
    dst = tmp_path / "back.bin"
    rc, out, err = cli(meta, "kv", "get", "blk-1", str(dst))
    assert rc == 0, err
    assert dst.read_bytes() == src.read_bytes()
    rc, out, err = cli(meta, "kv", "stat", "blk-1", "--json")
    assert rc == 0, err
    st = json.loads(out)
    assert st["present"] and st["size"] == 102400 and len(st["held_by"]) == 1 and st["ttl_left_s"] is None
    rc, out, err = cli(meta, "kv", "put", "blk-ttl", str(src), "--ttl", "300")
    assert rc == 0, err
    rc, out, err = cli(meta, "kv", "stat", "blk-ttl", "--json")
    assert rc == 0 and 290 < json.loads(out)["ttl_left_s"] <= 300, out
    rc, out, err = cli(meta, "kv", "stat", "blk-ttl")
    assert rc == 0 and re.search(r"expires in (29\d|300)\.\d s", out), out
    rc, out, err = cli(meta, "kv", "rm", "blk-1")
    assert rc == 0 and "deleted" in out, err
    rc, out, err = cli(meta, "kv", "stat", "blk-1")
    assert rc == 1 and "not in pool default" in out
    rc, out, err = cli(meta, "kv", "get", "blk-1", str(dst))
    assert rc == 1 and "no KV object 'blk-1'" in err and "Traceback" not in err
    rc, out, err = cli(meta, "kv", "rm", "blk-1")
    assert rc == 1 and "no KV object" in err


def test_bad_input_errors(meta: str, tmp_path: Path) -> None:
    rc, _, err = cli(meta, "kv", "put", "k", str(tmp_path / "missing"))
    assert rc == 1 and "cannot read" in err
    rc, _, err = cli(meta, "kv", "put", "x" * 600, "/dev/null")
    assert rc == 1 and "exceeds the limit of 512" in err
    rc, _, err = cli(meta, "kv", "get", "k", "--pool", "nope")
    assert rc == 1 and "unknown KV pool 'nope'" in err
    rc, _, err = cli(meta, "kv", "put", "k", "/dev/null", "--ttl", "-1")  # a usage error (before: rc 1)
    assert rc == 2 and "--ttl" in err and "must be a number of seconds > 0" in err, err
    # An endless source is cut at the largest object the pool could take
    # (it used to be read until memory ran out).
    rc, _, err = cli(meta, "kv", "put", "zeros", "/dev/zero")
    assert rc == 1 and "/dev/zero holds more than 134217728 bytes" in err, err
    assert cli(meta, "kv", "stat", "zeros")[0] == 1
    # An EC value whose fragments exceed the per-target budget: the daemons'
    # reason, as the error's class, not "unavailable" (which invites retries).
    define_pool(meta.split(","), "tiny-ec", redundancy="ec:2+1", target_memory=1 << 20)
    pool_served(meta.split(","), "tiny-ec")
    (tmp_path / "big.bin").write_bytes(bytes(4 << 20))
    rc, _, err = cli(meta, "kv", "put", "big", str(tmp_path / "big.bin"), "--pool", "tiny-ec")
    assert rc == 1 and "stored 0 of 2+1 fragments" in err and "can never fit" in err, err


def test_stats_status_and_metrics(cl: LocalCluster, meta: str, tmp_path: Path) -> None:
    src = tmp_path / "v"
    src.write_bytes(b"v" * 5000)
    for i in range(12):
        assert cli(meta, "kv", "put", f"s{i}", str(src))[0] == 0
        assert cli(meta, "kv", "get", f"s{i}", str(tmp_path / "o"))[0] == 0
    cli(meta, "kv", "get", "never", str(tmp_path / "o"))

    def objects() -> int:
        rc, out, err = cli(meta, "kv", "stats", "--pool", "default", "--json")
        assert rc == 0, err
        return int(json.loads(out)["pools"][0]["usage"]["objects"])
    end = time.monotonic() + 20
    while objects() < 12:  # heartbeats carry the usage to meta
        assert time.monotonic() < end, "KV usage never reached meta"
        time.sleep(0.3)
    rc, out, _ = cli(meta, "kv", "stats", "--json")
    got = json.loads(out)["pools"][0]
    assert {t["state"] for t in got["targets"]} == {"online"}, got["targets"]
    # a target that is not online shows its last report, marked as such (it read as current)
    got["targets"][0]["state"] = "offline"
    text = render_stats({"pools": [got]})
    assert f"  target {got['targets'][0]['id']} (offline: its last report): " in text, text
    assert text.count("its last report") == 1
    rc, out, _ = cli(meta, "kv", "stats")
    assert rc == 0 and "pool default (replica:1)" in out and "  target " in out and "its last report" not in out
    assert "last reported at their heartbeats" in out  # says why a put made just now may not show
    _, out, _ = cli(meta, "status", "--json")
    st = json.loads(out)
    default = next(p for p in st["kv_pools"] if p["name"] == "default")
    assert default["usage"]["objects"] >= 12 and default["usage"]["hits"] >= 12
    assert len(default["targets"]) == 3
    rc, out, _err = cli(meta, "status")
    assert "KV POOL" in out and "default" in out
    # The daemons' own Prometheus endpoints: per pool and target, hits, misses, evictions.
    text = ""
    for p in cl.procs:
        if p.kind != "storage":
            continue
        ready = json.loads((cl.dir / "logs" / f"{p.name}.out").read_text().splitlines()[-1])
        with urllib.request.urlopen(f"http://{ready['metrics']}/metrics", timeout=10) as resp:
            text += resp.read().decode()
    assert 'tierfs_kv_events_total{event="hits",pool="default"' in text
    assert 'event="misses",pool="default"' in text and 'event="evictions",pool="default"' in text
    assert "tierfs_kv_objects{" in text
    hits = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('tierfs_kv_events_total{event="hits",pool="default"'))
    assert hits >= 12


def test_replay_live_and_simulated(meta: str, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = public_trace_path().read_text().splitlines()[:60]
    trace.write_text("\n".join(lines) + "\n")
    rc, out, err = cli(meta, "kv", "replay", str(trace), "--simulate", "--cluster", "20%", "--json")
    assert rc == 0, err
    sim = json.loads(out)
    assert sim["requests"] == 60 and 0 <= sim["hit_ratio"]["total"] <= 1
    rc, out, err = cli(meta, "kv", "replay", str(trace), "--dram", "50", "--cluster", "20%",
                       "--block-size", "16KiB", "--json", "--prefill-tokens-per-s", "10000")
    assert rc == 0, err
    live = json.loads(out)
    for field in ("requests", "blocks", "hit_ratio", "policy", "bytes_loaded", "load_latency_ms"):
        assert field in live
    assert live["requests"] == 60 and live["blocks"] == sim["blocks"]
    assert set(live["hit_ratio"]) >= {"dram", "ssd", "cluster", "total"}
    assert live["hit_ratio"]["total"] > 0 and live["bytes_loaded"] > 0
    assert live["load_latency_ms"]["p50"] > 0
    # the temporary pool is gone again
    rc, out, err = cli(meta, "kv", "pool", "ls", "--json")
    assert not [p for p in json.loads(out) if p["name"].startswith("replay-")]
    rc, out, err = cli(meta, "kv", "replay", str(tmp_path / "nope.jsonl"), "--simulate")
    assert rc == 1 and "Traceback" not in err
    # a bad policy in a live replay is said as such (it was "no KV pool
    # 'replay-...'", from removing the pool that was never made)
    rc, out, err = cli(meta, "kv", "replay", str(trace), "--cluster", "5%", "--policy", "bogus")
    assert rc == 1 and "unknown eviction policy 'bogus'" in err and "no KV pool" not in err, err
    rc, out, err = cli(meta, "kv", "replay", str(trace), "--simulate", "--cluster", "5%", "--limit", "-1")
    assert rc == 1 and "--limit -1" in err, err  # it silently dropped the last request
    rc, out, err = cli(meta, "kv", "replay", str(trace), "--simulate", "--dram", "5", "--cluster", "5%",
                       "--policy", "dram=s3fifo", "--json")
    assert rc == 0 and json.loads(out)["tiers"]["cluster"]["policy"] == "lru", err
    # --tokens-per-block counts in a simulation too (it used 512 whatever was given, until stop 47)
    saved = []
    for tpb in ("0", "16"):
        rc, out, err = cli(meta, "kv", "replay", str(public_trace_path()), "--simulate", "--cluster", "10%", "--json",
                           "--tokens-per-block", tpb, "--prefill-tokens-per-s", "1000", "--load-gbps", "10")
        assert rc == 0, err
        saved.append(json.loads(out)["prefill"]["prefill_saved_s"])
    assert saved[0] == 0 and saved[1] > 0, saved
    # a pool of a few blocks: its budget is meta's smallest, not a refusal (until stop 47)
    rc, out, err = cli(meta, "kv", "replay", str(trace), "--dram", "2", "--cluster", "10", "--block-size", "4KiB",
                       "--limit", "5", "--json")
    assert rc == 0 and json.loads(out)["requests"] == 5, err


def test_replay_with_cluster_as_a_user_says_why_it_was_refused(meta: str, tmp_path: Path) -> None:
    """--cluster makes a temporary pool, an admin operation. A user's run
    was refused at the create, and then its clean-up's remove (refused too)
    answered instead: "RemoveKVPool is an admin operation", for a pool the
    user never asked to remove (until stop 48)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(public_trace_path().read_text().splitlines()[:5]) + "\n")
    rc, out, err = cli(meta, "user", "add", "replayer", "--uid", "7401", "--gid", "7401")
    assert rc == 0, err
    token = out.split()[0]
    assert token.startswith("tfu1.replayer."), out
    out_io, err_io = io.StringIO(), io.StringIO()
    rc = run(["kv", "replay", str(trace), "--cluster", "10", "--block-size", "4KiB", "--meta", meta],
             stdout=out_io, stderr=err_io, env={"TIERFS_TOKEN": token}, tty=False)
    err = err_io.getvalue()
    assert rc == 1 and "CreateKVPool is an admin operation" in err, err
    assert "RemoveKVPool" not in err and "needs an admin token" in err, err
    # the same user replays into an existing pool
    out_io, err_io = io.StringIO(), io.StringIO()
    rc = run(["kv", "replay", str(trace), "--block-size", "4KiB", "--json", "--meta", meta],
             stdout=out_io, stderr=err_io, env={"TIERFS_TOKEN": token}, tty=False)
    assert rc == 0 and json.loads(out_io.getvalue())["requests"] == 5, err_io.getvalue()


@pytest.mark.timeout(120)
def test_replay_stopped_by_sigterm_removes_its_pool(meta: str, tmp_path: Path) -> None:
    """timeout(1) and job schedulers stop with SIGTERM: the live replay's
    temporary pool is removed as after Ctrl-C (it was left behind until
    stop 47)."""
    import signal
    import subprocess
    import sys

    trace = tmp_path / "t.jsonl"
    trace.write_text(public_trace_path().read_text())
    env = dict(os.environ, TIERFS_META=meta, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.Popen([sys.executable, "-m", "tierfs.cli", "kv", "replay", str(trace), "--cluster", "20%",
                          "--block-size", "8KiB"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 60
        while not [x for x in json.loads(cli(meta, "kv", "pool", "ls", "--json")[1]) if x["name"].startswith("replay-")]:
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < end, "the replay's pool never appeared"
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0 and b"Traceback" not in err, err
    left = [x["name"] for x in json.loads(cli(meta, "kv", "pool", "ls", "--json")[1]) if x["name"].startswith("replay-")]
    assert not left, (left, err)


@pytest.mark.timeout(120)
def test_replay_simulate_needs_no_cluster(tmp_path: Path) -> None:
    """`--simulate` runs the policies without I/O (docs/kv.md): with no
    cluster set up at all (no --meta, no TIERFS_META, no ./.tierfs) it
    reports, where it failed with "no meta address"."""
    import subprocess
    import sys

    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(public_trace_path().read_text().splitlines()[:200]) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERFS_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    p = subprocess.run([sys.executable, "-m", "tierfs.cli", "kv", "replay", str(trace), "--simulate",
                        "--cluster", "10%", "--json"], env=env, cwd=tmp_path, capture_output=True, text=True,
                       timeout=100)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["mode"] == "simulate" and r["requests"] == 200 and 0 <= r["hit_ratio"]["total"] <= 1
    # a live replay still needs one, and says so
    p = subprocess.run([sys.executable, "-m", "tierfs.cli", "kv", "replay", str(trace), "--cluster", "10%"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert p.returncode != 0 and "no meta address" in p.stderr, p.stderr


@pytest.mark.parametrize("option,value", [("--tokens-per-block", "-3"), ("--tokens-per-block", "x"),
                                          ("--load-gbps", "nan"), ("--load-gbps", "inf"), ("--load-gbps", "-2"),
                                          ("--prefill-tokens-per-s", "nan"), ("--prefill-tokens-per-s", "inf")])
def test_replay_refuses_rates_and_block_tokens_that_are_no_numbers(option: str, value: str) -> None:
    """A negative --tokens-per-block reported negative hit tokens and prefill
    time saved; NaN and infinity rates gave nan or 0 load times. Usage errors
    naming the option now (parsed before any cluster is asked)."""
    trace = str(public_trace_path())
    out, err = io.StringIO(), io.StringIO()
    args = ["kv", "replay", trace, "--simulate", "--cluster", "5%", "--limit", "50", "--meta", "127.0.0.1:1"]
    extra = {"--tokens-per-block": ["--prefill-tokens-per-s", "100", "--load-gbps", "1"],
             "--load-gbps": ["--prefill-tokens-per-s", "100"], "--prefill-tokens-per-s": ["--load-gbps", "1"]}[option]
    rc = run([*args, *extra, option, value], stdout=out, stderr=err, env={}, tty=False)
    assert rc == 2 and f"argument {option}" in err.getvalue(), (rc, out.getvalue(), err.getvalue())
