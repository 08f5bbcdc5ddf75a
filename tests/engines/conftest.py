"""Fixtures for the engine-adapter tests (tests/engines), which run in
.venv-engines (make engines): one real TierFS cluster for the whole session
(3 meta replicas, 3 storage daemons on loopback), shared by the LMCache,
SGLang and vLLM tests. A test that kills a daemon restarts it before it
returns (``killed_storage``)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import FAST_META
from tests.kv.pools import define_pool, pool_served, wait_for  # noqa: F401 - wait_for: for the tests
from tierfs.local import LocalCluster

N_STORAGE = 3


def create_pool(meta: list[str], name: str, **kw: Any) -> None:
    define_pool(meta, name, **kw)
    pool_served(meta, name)


@pytest.fixture(scope="session")
def tierfs_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("engines-cluster"), n_storage=N_STORAGE,
                     extra_meta_args=list(FAST_META))
    c.up(timeout=120)
    pool_served(c.meta_addrs, "default")
    yield c
    c.stop()


@pytest.fixture(scope="session")
def tierfs_meta(tierfs_cluster: LocalCluster) -> str:
    """The cluster's meta addresses as TIERFS_META spells them."""
    return ",".join(tierfs_cluster.meta_addrs)


@pytest.fixture
def tierfs_env(tierfs_meta: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """TIERFS_META set for this test (engines' subprocesses inherit it)."""
    monkeypatch.setenv("TIERFS_META", tierfs_meta)
    return tierfs_meta


@pytest.fixture
def fresh_pool(tierfs_cluster: LocalCluster, request: pytest.FixtureRequest) -> str:
    """A new empty KV pool (replica:1) for this test, so tests never see
    each other's keys; its name is returned."""
    # The node id's hash keeps parametrized tests whose names differ only
    # past the cut apart.
    digest = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8]
    name = "t-" + "".join(ch if ch.isalnum() else "-" for ch in request.node.name)[:32] + f"-{digest}-{os.getpid()}"
    create_pool(tierfs_cluster.meta_addrs, name, target_memory=256 << 20, target_disk=1 << 30)
    return name


@pytest.fixture
def killed_storage(tierfs_cluster: LocalCluster) -> Iterator[Callable[[str], None]]:
    """``kill("storage-1")`` SIGKILLs that daemon; it is started again, and
    the cluster waited healthy, when the test ends."""
    killed: list[str] = []

    def kill(name: str) -> None:
        tierfs_cluster.kill(name)
        killed.append(name)

    yield kill
    if killed:
        tierfs_cluster.start(names=killed, timeout=60)
        asyncio.run(tierfs_cluster.wait_healthy(60))


@contextmanager
def env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


REPO = Path(__file__).resolve().parents[2]
