"""tierfs.integrations.common: where an engine adapter finds its cluster and
pool (the engine's config, then TIERFS_META / TIERFS_KV_POOL, then the
default pool), and the start-up check that fails fast, naming the setting."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.faults.harness import FAST_META
from tests.kv.pools import pool_served
from tierfs.errors import ConfigError
from tierfs.integrations.common import connect, resolve
from tierfs.local import LocalCluster, free_ports

pytestmark = pytest.mark.timeout(180)


def test_config_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERFS_META", "10.0.0.1:1")
    monkeypatch.setenv("TIERFS_KV_POOL", "envpool")
    t = resolve({"m": "127.0.0.1:7100, 127.0.0.1:7101", "p": "hot"}, meta_key="m", pool_key="p")
    assert t.meta == ("127.0.0.1:7100", "127.0.0.1:7101") and t.pool == "hot"
    assert t.meta_setting == "'m'" and t.pool_setting == "'p'"
    t = resolve({"m": ["127.0.0.1:1", "127.0.0.1:2"]}, meta_key="m", pool_key="p")
    assert t.meta == ("127.0.0.1:1", "127.0.0.1:2") and t.pool == "envpool"


def test_environment_then_default_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERFS_META", "127.0.0.1:7100")
    monkeypatch.delenv("TIERFS_KV_POOL", raising=False)
    t = resolve(None, meta_key="m", pool_key="p")
    assert t.meta == ("127.0.0.1:7100",) and t.pool == "default"
    assert t.meta_setting == "TIERFS_META"


@pytest.mark.parametrize("cfg,needle", [
    ({}, "no TierFS meta address"),
    ({"m": "localhost"}, "'localhost' is not host:port"),
    ({"m": 7100}, "must be 'host:port,...'"),
    ({"m": "127.0.0.1:1", "p": 3}, "must be a pool name"),
])
def test_bad_settings_name_the_setting(monkeypatch: pytest.MonkeyPatch, cfg: dict[str, object], needle: str) -> None:
    monkeypatch.delenv("TIERFS_META", raising=False)
    with pytest.raises(ConfigError, match=needle) as ei:
        resolve(cfg, meta_key="m", pool_key="p", where="X extra_config")
    assert ei.value.field.startswith(("X extra_config", "TIERFS_META"))


def test_unreachable_cluster_fails_fast_naming_the_setting() -> None:
    (port,) = free_ports(1)
    t = resolve({"m": f"127.0.0.1:{port}"}, meta_key="m", pool_key="p", where="X extra_config")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"X extra_config 'm': cannot reach the TierFS cluster") :
        connect(t, timeout=1.5)
    assert time.monotonic() - t0 < 10


def test_adapter_client_has_no_local_tiers_whatever_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/engines.md: the adapters turn TierFS's client DRAM and SSD tiers
    off (the engine's CPU buffer is the DRAM tier). A TIERFS_KV_DRAM_BYTES,
    TIERFS_KV_SSD_* or TIERFS_KV_WRITE_BACK in the environment, meant for
    other clients, gave the adapter's client a second DRAM copy, an SSD
    file, and stores acknowledged before the cluster had them."""
    c = LocalCluster(tmp_path / "c", n_meta=1, n_storage=1, extra_meta_args=list(FAST_META))
    c.up(timeout=120)
    try:
        pool_served(c.meta_addrs, "default")
        ssd = tmp_path / "ssd"
        ssd.mkdir()
        monkeypatch.setenv("TIERFS_KV_DRAM_BYTES", "16MiB")
        monkeypatch.setenv("TIERFS_KV_SSD_PATH", str(ssd))
        monkeypatch.setenv("TIERFS_KV_SSD_BYTES", "16MiB")
        monkeypatch.setenv("TIERFS_KV_WRITE_BACK", "1")
        client = connect(resolve({"m": ",".join(c.meta_addrs)}, meta_key="m", pool_key="p"), timeout=30)
        try:
            cfg = client.config
            assert (cfg.kv_dram_bytes, cfg.kv_ssd_bytes, cfg.kv_ssd_path, cfg.kv_write_back) == (0, 0, "", False)
            kv = client.kv_pool("default")
            assert kv.put(b"k", b"v" * 5000)
            assert kv.get(b"k") == b"v" * 5000
            assert client.aclient._kv_local() is None
            assert list(ssd.iterdir()) == []
        finally:
            client.close()
    finally:
        c.stop()
