"""Fixtures for the FUSE tests: one cluster and one daemon-mode mount per
module, unmounted at teardown whatever happened."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.client.util import start_cluster
from tests.fuse.util import Mount
from tierfs.client import Client
from tierfs.local import LocalCluster

#: The test directory's chunk size (the smallest TierFS allows): file sizes
#: of a few hundred KiB cross several chunk boundaries.
CHUNK = 64 * 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cl = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield cl
    cl.stop()


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.meta_addrs, request_timeout=5.0) as c:
        c.mkdir("/t", exist_ok=True)
        c.set_layout("/t", chunk_size=CHUNK)
        yield c


@pytest.fixture(scope="module")
def mnt(cluster: LocalCluster, client: Client, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The mount's root (TierFS ``/``); tests work under ``mnt / "t"``."""
    base = tmp_path_factory.mktemp("fuse")
    m = Mount(base / "mnt", cluster.meta_addrs, base / "mount.log")
    try:
        yield m.path
    finally:
        m.close()
