"""Meta failover: SIGKILL of the leader to the first acknowledged write.

A real 3-replica ``tierfs-meta`` cluster (three processes, loopback, the
namespace state machine) and a :class:`tierfs.meta.MetaClient` with two
writers making directories back to back. Each trial SIGKILLs the leader and
measures, from the kill:

* **failover**: until the first mkdir *issued after* the kill is
  acknowledged (what an application sees);
* **election**: until the new leader logged its election (the replica's
  own log line, wall clock);

then restarts the killed replica and waits until it has caught up. The
baseline, in the same run: the same cluster with ``--leader-lost-election 0``
(followers wait a whole election timeout after the leader's connection
closed, as before; forwarding and the client's fast path stay), and the
configured election timeout. Target: failover under 1 s.

    python -m bench.bench_failover [--quick]
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET_S = 1.0
_LEADER_LINE = re.compile(r"-> leader \(term")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def log_lines(log_text: str) -> list[tuple[float, str]]:
    """(wall time, message) of a replica's log, JSON or text format."""
    out: list[tuple[float, str]] = []
    for line in log_text.splitlines():
        try:
            doc = json.loads(line)
            out.append((float(doc["ts"]), str(doc["msg"])))
            continue
        except (ValueError, KeyError, TypeError):
            pass
        try:  # text: "2026-12-01 23:34:36,183 INFO ..." (local time)
            ts = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000
        except ValueError:
            continue
        out.append((ts, line[24:]))
    return out


def _elected_at(log_text: str, after_wall: float) -> float | None:
    """Wall time of the first "-> leader" line logged after ``after_wall``."""
    return next((ts for ts, msg in log_lines(log_text) if ts >= after_wall and _LEADER_LINE.search(msg)), None)


async def _writer(mc: Any, name: str, stop: asyncio.Event, lat: list[tuple[float, float]]) -> None:
    i = 0
    while not stop.is_set():
        t0 = time.monotonic()
        await mc.mkdir(f"/fo/{name}-{i}")
        lat.append((t0, time.monotonic()))
        i += 1


async def _trial(c: Any, n: int) -> tuple[float, float | None]:
    from tierfs.meta import MetaClient

    leader = c.wait_leader()
    lat: list[tuple[float, float]] = []
    stop = asyncio.Event()
    async with MetaClient(c.addresses, deadline=20.0, attempt_timeout=1.0) as mc:
        if n == 0:
            await mc.mkdir("/fo")
        await mc.stat("/fo")  # the client knows the leader
        writers = [asyncio.create_task(_writer(mc, f"t{n}w{w}", stop, lat)) for w in range(2)]
        while len(lat) < 20:
            await asyncio.sleep(0.005)
        t_wall, t_kill = time.time(), time.monotonic()
        c.kill(leader)
        deadline = t_kill + 30
        while not any(t0 >= t_kill for t0, _ in lat):
            if time.monotonic() > deadline:
                raise RuntimeError("no write acknowledged within 30 s of the leader's SIGKILL")
            await asyncio.sleep(0.002)
        stop.set()
        await asyncio.gather(*writers)
    failover = min(t1 for t0, t1 in lat if t0 >= t_kill) - t_kill
    new = c.wait_leader()
    ts = _elected_at(c.log(new), t_wall)
    c.start(leader)
    # caught up (and knows the leader) before the next trial kills someone
    from tests.cluster import wait_for

    wait_for(lambda: c.status(leader).raft.ready and bool(c.status(leader).leader), 30,
             "the restarted replica to catch up")
    return failover, (ts - t_wall) if ts is not None else None


def _series(tmp: Path, trials: int, extra: list[str]) -> tuple[list[float], list[float]]:
    from tests.cluster import MetaCluster

    fo: list[float] = []
    el: list[float] = []
    with MetaCluster(tmp, n=3, state_machine="meta", extra_args=extra) as c:
        c.wait_leader()
        for n in range(trials):
            f, e = asyncio.run(_trial(c, n))
            fo.append(f)
            if e is not None:
                el.append(e)
    return fo, el


def run(quick: bool) -> dict[str, Any]:
    from tierfs.meta.config import MetaConfig

    trials = 3 if quick else 10
    cfg = MetaConfig()
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as td:
        fast, fast_el = _series(Path(td) / "fast", trials, [])
        slow, slow_el = _series(Path(td) / "stock", trials, ["--leader-lost-election=0"])

    def row(case: str, value: float, base: float | None, base_name: str) -> dict[str, Any]:
        return {"case": case, "value": round(value, 3), "unit": "s",
                "baseline": None if base is None else round(base, 3), "baseline_name": base_name,
                "ratio": None if not base else round(value / base, 3)}

    rows = [
        row("failover p50 (SIGKILL of leader -> first acked write)", _pct(fast, 0.5), TARGET_S, "target"),
        row("failover max", max(fast), TARGET_S, "target"),
        row("failover p50, leader_lost_election=0 (election waits its timeout)", _pct(slow, 0.5), TARGET_S, "target"),
        row("failover p50 vs before", _pct(fast, 0.5), _pct(slow, 0.5), "leader_lost_election=0, same run"),
        row("SIGKILL -> new leader elected, p50", _pct(fast_el, 0.5) if fast_el else float("nan"),
            cfg.election_timeout_min, "configured election timeout (min)"),
        row("SIGKILL -> new leader elected, p50, leader_lost_election=0",
            _pct(slow_el, 0.5) if slow_el else float("nan"), cfg.election_timeout_min,
            "configured election timeout (min)"),
        row("election timeout configured (min / max)", cfg.election_timeout_min, cfg.election_timeout_max,
            "max"),
        row("leader_lost_election configured", cfg.leader_lost_election, cfg.election_timeout_min,
            "election timeout (min)"),
    ]
    met = max(fast) < TARGET_S
    notes = (f"{trials} trials per series; 3 replicas (3 processes) and the client on one machine, loopback. "
             f"failover = SIGKILL of the leader to the first mkdir issued after it acknowledged (2 writers in "
             f"flight). All trials: {', '.join(f'{x:.3f}' for x in fast)} s; with leader_lost_election=0 (the election waits its "
             f"timeout; forwarding and the client's fast path kept): "
             f"{', '.join(f'{x:.3f}' for x in slow)} s. Target < {TARGET_S:.0f} s: "
             f"{'met' if met else 'MISSED'} (max {max(fast):.3f} s).")
    return {"name": "failover", "rows": rows, "notes": notes}


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=2))
