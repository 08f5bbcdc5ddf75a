"""StorageConfig: defaults, TOML/env/flag precedence, errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierfs.config import load
from tierfs.errors import ConfigError
from tierfs.storage.config import StorageConfig


def test_defaults_and_target_dirs(tmp_path: Path) -> None:
    cfg = load(StorageConfig, env={}, overrides={"data_dir": str(tmp_path)})
    assert cfg.target_dirs() == [tmp_path / "target0"]
    assert cfg.io_backend == "auto" and cfg.max_fragment_size <= cfg.max_frame_bytes


def test_precedence(tmp_path: Path) -> None:
    toml = tmp_path / "s.toml"
    toml.write_text('[storage]\ntargets = ["/a", "/b"]\nqueue_depth = 8\nheartbeat_interval = "2s"\n'
                    'reserved_bytes = "1GiB"\n')
    env = {"TIERFS_STORAGE_QUEUE_DEPTH": "16", "TIERFS_STORAGE_META_ADDRS": "h1:1,h2:2"}
    cfg = load(StorageConfig, toml, env=env, overrides={"heartbeat_interval": "250ms", "port": None})
    assert cfg.target_dirs() == [Path("/a"), Path("/b")]
    assert cfg.queue_depth == 16  # env beats TOML
    assert cfg.heartbeat_interval == 0.25  # flag beats TOML
    assert cfg.meta_addrs == ["h1:1", "h2:2"] and cfg.reserved_bytes == 1 << 30


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"io_backend": "spdk"}, "io_backend"),
        ({"queue_depth": 0}, "queue_depth"),
        ({"port": 70000}, "port"),
        ({"meta_addrs": ["nohost"]}, "meta_addrs"),
        ({"transports": ["carrier-pigeon"]}, "transports"),
        ({"max_fragment_size": "1GiB"}, "max_fragment_size"),
        ({"targets": ["/x", "/x/"]}, "targets"),
        ({"scrub_rate": -1}, "scrub_rate"),
        ({"metrics_addr": "localhost"}, "metrics_addr"),
        ({"reserved_bytes": "lots"}, "reserved_bytes"),
        ({"min_free": "lots"}, "min_free"),
        ({"min_free": "150%"}, "min_free"),
        ({"rebuild_concurrency": 0}, "rebuild_concurrency"),
    ],
)
def test_bad_values_name_the_field(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load(StorageConfig, env={}, overrides=overrides)
    assert ei.value.field == field


def test_min_free_is_a_size_or_a_percentage() -> None:
    assert load(StorageConfig, env={}).min_free_limit() == (64 << 20, 0.0)
    assert load(StorageConfig, env={}, overrides={"min_free": "2MiB"}).min_free_limit() == (2 << 20, 0.0)
    assert load(StorageConfig, env={}, overrides={"min_free": "1%"}).min_free_limit() == (0, 0.01)
    assert load(StorageConfig, env={"TIERFS_STORAGE_MIN_FREE": "0"}).min_free_limit() == (0, 0.0)
