"""The meta replicas' Prometheus endpoints, scraped live (a LocalCluster's
meta replicas, which `tierfs up` plans with a metrics port each), and the
Grafana dashboard's references to the metrics the daemons export."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster import wait_for
from tierfs.errors import NotFoundError
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "tierfs.json"
META = ("meta-0", "meta-1", "meta-2")


def _scrape(addr: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _get(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), float("nan"))


@pytest.mark.timeout(90)
def test_meta_metrics_endpoint_live(tmp_path: Path) -> None:
    cl = LocalCluster(tmp_path / "c", n_meta=3, n_storage=1)
    try:
        cl.start(names=list(META))
        metrics = cl.metrics_addrs
        assert sorted(metrics) == list(META), metrics

        def one_leader() -> bool:
            ms = [_scrape(a) for a in metrics.values()]
            leaders = [_get(m, "tierfs_meta_role", role="leader") for m in ms]
            terms = {_get(m, "tierfs_meta_term") for m in ms}
            return leaders.count(1.0) == 1 and leaders.count(0.0) == 2 and len(terms) == 1 and min(terms) >= 1

        wait_for(one_leader, 30, "one leader among three, all in one term >= 1")
        scraped = {n: _scrape(a) for n, a in metrics.items()}
        lead = next(n for n, m in scraped.items() if _get(m, "tierfs_meta_role", role="leader") == 1.0)
        for n, m in scraped.items():
            roles = [_get(m, "tierfs_meta_role", role=r) for r in ("leader", "follower", "candidate")]
            assert sorted(roles) == [0.0, 0.0, 1.0], (n, roles)
            assert _get(m, "tierfs_meta_apply_lag") >= 0, n
            assert _get(m, "tierfs_meta_journal_bytes") > 0, n
            assert _get(m, "tierfs_meta_leader_changes_total") >= 1, n
            assert _get(m, "tierfs_meta_commit_index") >= 1, n
        before = _get(scraped[lead], "tierfs_meta_commit_seconds_count")

        async def mkdirs() -> None:
            async with MetaClient(cl.meta_addrs, deadline=20.0, data_dir=str(cl.dir)) as mc:
                for i in range(3):
                    await mc.mkdir(f"/m{i}")
                with pytest.raises(NotFoundError):
                    await mc.stat("/not-there")

        asyncio.run(mkdirs())
        after = _scrape(metrics[lead])
        if _get(after, "tierfs_meta_role", role="leader") == 1.0:  # no election meanwhile
            assert _get(after, "tierfs_meta_commit_seconds_count") >= before + 3, (before, after)
            assert _get(after, "tierfs_meta_rpcs_total", method="Mkdir", code="OK") >= 1
            buckets = [v for (name, _), v in after.items() if name == "tierfs_meta_commit_seconds_bucket"]
            assert max(buckets) == _get(after, "tierfs_meta_commit_seconds_count")
        # errors are counted by their gRPC status
        assert sum(_get(_scrape(a), "tierfs_meta_rpcs_total", method="Stat", code="NOT_FOUND") > 0
                   for a in metrics.values()) >= 1
    finally:
        cl.stop()


@pytest.mark.timeout(120)
def test_storage_metrics_endpoints_of_a_local_cluster(tmp_path: Path) -> None:
    """`tierfs up` plans a metrics port for each storage daemon too, and a
    grown one gets its own (they had none: the KV and data-plane metrics
    the docs name could not be seen on a local cluster)."""
    cl = LocalCluster(tmp_path / "c", n_meta=1, n_storage=1)
    try:
        cl.up(timeout=90)
        cl.grow(2)
        cl.start(names=["storage-1"], timeout=60)
        metrics = cl.storage_metrics_addrs
        assert sorted(metrics) == ["storage-0", "storage-1"], metrics
        assert len(set(metrics.values()) | set(cl.metrics_addrs.values())) == 3  # every port its own
        for name, addr in metrics.items():
            def served(a: str = addr) -> bool:
                m = _scrape(a)
                return _get(m, "tierfs_dataplane", counter="connections_total") >= 0
            wait_for(served, 30, f"{name}'s data-plane counters at http://{addr}/metrics")
            m = _scrape(addr)
            assert any(n.startswith("tierfs_storage_kv_") for n, _ in m), sorted({n for n, _ in m})[:20]
    finally:
        cl.stop()


def _exported_names() -> tuple[set[str], set[str]]:
    """Metric names the daemons' code registers or yields (string literals
    starting tierfs_), and the prefixes of names built with an f-string."""
    names: set[str] = set()
    prefixes: set[str] = set()
    for path in (REPO / "tierfs").rglob("*.py"):
        text = path.read_text()
        names.update(re.findall(r"""["'](tierfs_[a-z0-9_]+)["']""", text))
        prefixes.update(re.findall(r"""f["'](tierfs_[a-z0-9_]+)\{""", text))
    return names, prefixes


def test_dashboard_references_only_exported_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["panels"], list)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"\btierfs_[a-z0-9_]+", e)}
    names, prefixes = _exported_names()
    missing = []
    for n in sorted(used):
        base = re.sub(r"_(total|bucket|count|sum|created)$", "", n)
        if not ({n, base} & names or any(n.startswith(p) for p in prefixes)):
            missing.append(n)
    assert not missing, f"the dashboard uses metrics no daemon exports: {missing}"
    for required in ("tierfs_meta_term", "tierfs_meta_role", "tierfs_meta_commit_seconds_bucket",
                     "tierfs_meta_apply_lag", "tierfs_meta_journal_bytes", "tierfs_target_used_bytes"):
        assert required in used, f"no panel shows {required}"
