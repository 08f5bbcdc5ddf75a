"""The rebuild progress a storage daemon reports (`tierfs status`: "group G:
rebuilding target(s) [T]: done/total chunks, N written") never goes back
within one rebuild.

A rebuild lists its group's chunks twice (the second pass catches chunks
committed while the first ran). Until stop 49 the second pass restarted the
count at 0 while keeping the bytes: a copy all but finished read
"0/34 chunks, 4.1 MiB written" for as long as that pass took (seconds on a
loaded host; seen growing a 4-node cluster to 6 with a writer running).

The two passes follow each other within one round of the worker, too fast
to catch reliably from outside on real daemons, so this drives the
worker's own code (`Repairer._rebuild_group`) with the meta and peer
calls replaced by stubs: a chunk committed between the passes is what the
second pass rebuilds, and the progress is sampled while it does."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from tierfs.storage.api import FragmentKey
from tierfs.storage.repair import Repairer


class _Engine:
    target_id = 7

    def __init__(self) -> None:
        self.keys: set[FragmentKey] = set()

    def __contains__(self, key: object) -> bool:
        return key in self.keys


class _Meta:
    def __init__(self) -> None:
        self.finished: list[tuple[int, int]] = []

    async def finish_rebuild(self, gid: int, tid: int) -> None:
        self.finished.append((gid, tid))


@pytest.mark.timeout(30)
def test_the_second_pass_does_not_restart_the_count() -> None:
    eng, meta = _Engine(), _Meta()
    r = Repairer(meta, [eng])
    r.groups = {1: [5, 7, 9]}
    first = [(100 + i, 0, 1) for i in range(4)]
    late = (200, 0, 1)  # committed while the first pass ran: listed first by the second
    listings = [first, [late, *first]]
    samples: list[tuple[int, int, int]] = []

    async def group_chunks(gid: int) -> list[tuple[int, int, int]]:
        return list(listings.pop(0))

    async def load_files(inodes: Any, cache: dict[int, Any]) -> None:
        return None

    async def file(inode: int, cache: Any = None) -> Any:
        return SimpleNamespace(committed=lambda key: SimpleNamespace(missing=set()))

    async def restore(e: Any, key: FragmentKey, f: Any, members: list[int], *, source: int = 0) -> tuple[int, bool]:
        p = r.progress[(1, 7)]
        samples.append((p.done, p.total, p.bytes))
        eng.keys.add(key)
        await asyncio.sleep(0)
        return 1000, False

    r.group_chunks = group_chunks  # type: ignore[method-assign]
    r.load_files = load_files  # type: ignore[method-assign]
    r.file = file  # type: ignore[method-assign]
    r.restore = restore  # type: ignore[method-assign]

    assert asyncio.run(r._rebuild_group(1, 7))
    assert meta.finished == [(1, 7)]
    p = r.progress[(1, 7)]
    assert (p.done, p.total, p.bytes) == (5, 5, 5000), p
    # Five restores: four in the first pass, the late chunk in the second.
    assert len(samples) == 5, samples
    dones = [s[0] for s in samples]
    assert dones == sorted(dones), samples  # never back
    # While the second pass rebuilds the late chunk, the four copied are
    # still counted done (it read "0/5 chunks, 3.9 KiB written" before).
    assert samples[-1][0] >= 4 and samples[-1][2] == 4000, samples
    assert all(0 <= d <= t for d, t, _ in samples), samples
