"""tierfs.integrations.common: where an engine adapter finds its cluster and
pool (the engine's config, then TIERFS_META / TIERFS_KV_POOL, then the
default pool), and the start-up check that fails fast, naming the setting."""

from __future__ import annotations

import time

import pytest

from tierfs.errors import ConfigError
from tierfs.integrations.common import connect, resolve
from tierfs.local import free_ports

pytestmark = pytest.mark.timeout(60)


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
