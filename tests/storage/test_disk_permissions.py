"""What a storage daemon and a meta replica leave on disk is not readable by
other local accounts (docs/security.md, "Files on disk"): file data in
fragments, KV objects, meta's journal. A real local cluster (1 meta, 1
storage) writes a file and a KV object; every file under a daemon's data
directory that holds their bytes must sit behind a directory that other
accounts cannot search. Until stop 47 fragments and raft.log were 0644 in
0755 directories: any local user of a storage host read every file's data,
whatever its mode in TierFS."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierfs.client import AsyncClient
from tierfs.local import LocalCluster

pytestmark = pytest.mark.timeout(120)

MARK = b"not-for-other-accounts-" * 64
NAME = "a-private-name-in-the-journal"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cl = LocalCluster(tmp_path / "c", n_meta=1, n_storage=1)
    cl.up(timeout=90)
    try:
        yield cl
    finally:
        cl.stop()


def _others_can_read(path: Path, top: Path) -> bool:
    """Whether an account that is neither the owner nor in the group can
    read ``path``, given that it can reach ``top`` (the cluster directory;
    pytest makes the tmp directories above it 0700)."""
    for d in [top, *[p for p in path.parents if top in p.parents]]:
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(path).st_mode & stat.S_IROTH)


def test_data_and_journal_are_not_readable_by_other_accounts(cluster: LocalCluster) -> None:
    async def go() -> None:
        async with AsyncClient(cluster.meta_addrs, request_timeout=10.0) as c:
            await c.set_layout("/", redundancy="replica:1")
            await c.mkdir("/private", mode=0o700)
            await c.write_bytes(f"/private/{NAME}", MARK)
            assert await c.read_bytes(f"/private/{NAME}") == MARK
            await c.kv.put("k", MARK)
            assert await c.kv.get("k") == MARK
    asyncio.run(go())

    top = cluster.dir
    holding = [p for p in top.rglob("*") if p.is_file() and not p.is_symlink()
               and (MARK[:64] in (b := p.read_bytes()) or NAME.encode() in b) and "logs" not in p.parts]
    kinds = {("meta" if "meta-" in str(p.relative_to(top)) else "kv" if "/kv/" in str(p) else "frag")
             for p in holding}
    assert {"meta", "kv", "frag"} <= kinds, holding  # the bytes in a fragment and a KV object, the name in the journal
    exposed = [str(p.relative_to(top)) for p in holding if _others_can_read(p, top)]
    assert not exposed, f"readable by every local account: {exposed}"
