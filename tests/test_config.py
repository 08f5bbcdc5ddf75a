"""Config machinery: precedence, unit parsing, validation errors name the field."""

import dataclasses
from pathlib import Path

import pytest

from tierfs.config import BaseConfig, field, load, parse_duration, parse_size
from tierfs.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class _Cfg(BaseConfig):
    SECTION = "demo"
    chunk_size: int = field(4 << 20, "chunk size in bytes", kind="size")
    timeout: float = field(1.0, "timeout in seconds", kind="duration")
    peers: list[str] = field([], "peer addresses")
    name: str = field("x", "a name")
    fsync: bool = field(True, "fsync writes")

    def validate(self) -> None:
        if self.chunk_size <= 0 or self.chunk_size & (self.chunk_size - 1):
            raise ConfigError("must be a power of two", field="chunk_size")


def test_units() -> None:
    assert parse_size("4MiB") == 4 << 20
    assert parse_size("1GB") == 10**9
    assert parse_size("1PiB") == 1 << 50 and parse_size("2PB") == 2 * 10**15  # "not a size" until stop 45
    assert parse_size("1EiB") == 1 << 60
    assert parse_size(512) == 512
    assert parse_duration("500ms") == 0.5
    assert parse_duration("2m") == 120.0
    with pytest.raises(ValueError):
        parse_size("4 apples")


def test_precedence(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[demo]\nchunk_size = "1MiB"\nname = "file"\ntimeout = "2s"\n')
    env = {"TIERFS_DEMO_NAME": "env", "TIERFS_DEMO_TIMEOUT": "3s"}
    cfg = load(_Cfg, toml, env=env, overrides={"timeout": "250ms", "peers": None})
    assert cfg.chunk_size == 1 << 20  # TOML beats default
    assert cfg.name == "env"  # env beats TOML
    assert cfg.timeout == 0.25  # flag beats env
    assert cfg.peers == []  # None override = flag not given


def test_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as ei:
        load(_Cfg, env={"TIERFS_DEMO_CHUNK_SIZE": "3"})
    assert ei.value.field == "chunk_size" and "power of two" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        load(_Cfg, env={"TIERFS_DEMO_FSYNC": "maybe"})
    assert ei.value.field == "fsync"
    bad = tmp_path / "bad.toml"
    bad.write_text("[demo]\nchunk_sise = 4096\n")
    with pytest.raises(ConfigError) as ei:
        load(_Cfg, bad, env={})
    assert ei.value.field == "chunk_sise"
    with pytest.raises(ConfigError):
        load(_Cfg, tmp_path / "missing.toml", env={})
    with pytest.raises(ConfigError):
        load(_Cfg, env={}, overrides={"nope": 1})


def test_a_misspelled_or_missing_role_table_is_an_error(tmp_path: Path) -> None:
    """A daemon's file with [mata] for [meta] (or no table of its role at
    all) was read as empty until stop 47: the daemon started on defaults
    (a fresh one-replica meta cluster) without a word."""
    from tierfs.meta.config import MetaConfig
    from tierfs.storage.config import StorageConfig

    typo = tmp_path / "typo.toml"
    typo.write_text('[mata]\nraft_addr = "127.0.0.1:7000"\n')
    with pytest.raises(ConfigError, match=r"unknown table \[mata\]"):
        load(MetaConfig, typo, env={})
    other = tmp_path / "other.toml"
    other.write_text('[storage]\ndata_dir = "/x"\n')
    with pytest.raises(ConfigError, match=r"has no \[meta\] table \(only \[storage\]\)"):
        load(MetaConfig, other, env={})
    assert str(load(StorageConfig, other, env={}).data_dir) == "/x"
    shared = tmp_path / "shared.toml"
    shared.write_text('[meta]\ndata_dir = "/m"\n[storage]\ndata_dir = "/y"\n')
    assert str(load(StorageConfig, shared, env={}).data_dir) == "/y"
    load(MetaConfig, shared, env={})


def test_a_client_takes_a_client_config_as_its_first_argument() -> None:
    """``Client(ClientConfig(...))`` failed with "'ClientConfig' object is not
    iterable" (until stop 48): the config is taken as ``config=``."""
    from tierfs.client import Client, ClientConfig
    from tierfs.errors import InvalidArgumentError

    cfg = ClientConfig(meta=["127.0.0.1:1"], lease_ms=12345)
    c = Client(cfg)  # no connection is made until the first call
    try:
        assert c.config.meta == ["127.0.0.1:1"] and c.config.lease_ms == 12345
    finally:
        c.close()
    with pytest.raises(InvalidArgumentError, match="given twice"):
        Client(cfg, config=cfg)  # type: ignore[arg-type]
