"""Fixtures for the client SDK tests: one real cluster per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.client.util import start_cluster
from tierfs.client import Client
from tierfs.local import LocalCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Six storage nodes, three meta replicas, shared by a test module."""
    cl = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield cl
    cl.stop()


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[Client]:
    with Client(cluster.meta_addrs, request_timeout=5.0) as c:
        yield c
