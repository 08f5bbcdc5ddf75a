"""``ec:8+2`` needs ten fragments on ten distinct nodes: a ten-node cluster."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from tests.client.util import digest, random_bytes, start_cluster
from tierfs.client import Client
from tierfs.errors import InsufficientTargetsError, UnavailableError
from tierfs.local import LocalCluster

MiB = 1 << 20


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cl = start_cluster(tmp_path_factory.mktemp("wide"), n_storage=10)
    yield cl
    cl.stop()


@pytest.mark.timeout(180)
def test_ec_8_2_round_trip_and_two_dead_nodes(wide: LocalCluster) -> None:
    with Client(wide.meta_addrs, request_timeout=3.0, connect_timeout=1.0) as client:
        client.mkdir("/w")
        client.set_layout("/w", chunk_size=MiB, redundancy="ec:8+2")
        files = {}
        for i, n in enumerate([0, 1, MiB // 8 - 1, MiB // 8 + 1, MiB - 1, MiB, MiB + 1, 13 * MiB + 77]):
            files[f"/w/f{n}"] = random_bytes(n, seed=100 + i)
            client.write_bytes(f"/w/f{n}", files[f"/w/f{n}"])
        for path, data in files.items():
            st = client.stat(path)
            assert st.redundancy == "ec:8+2" and st.size == len(data)
            arr = np.empty(len(data), dtype=np.uint8)
            assert client.read_into(path, arr) == len(data)
            assert digest(arr) == digest(data)
        big = files[f"/w/f{13 * MiB + 77}"]
        rng = np.random.default_rng(3)
        with client.open(f"/w/f{13 * MiB + 77}") as f:
            for _ in range(30):
                off, n = int(rng.integers(0, len(big))), int(rng.integers(1, 2 * MiB))
                f.seek(off)
                assert f.read(n) == big[off: off + n]
        wide.kill("storage-1")
        wide.kill("storage-8")
        for path, data in files.items():
            assert digest(client.read_bytes(path)) == digest(data), path
        wide.kill("storage-4")
        with pytest.raises((InsufficientTargetsError, UnavailableError)):
            client.read_bytes(f"/w/f{13 * MiB + 77}")
