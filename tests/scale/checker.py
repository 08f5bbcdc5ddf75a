"""A data checker that runs while the cluster changes under it: writers
write new files (random bytes) and remember each one once its write is
acknowledged; readers re-read every acknowledged file, again and again, and
compare the bytes. Any wrong byte, short read or failed read of an
acknowledged file is recorded (``problems``); a failed write is only
counted (an unacknowledged file promises nothing)."""

from __future__ import annotations

import asyncio
import hashlib
import random
from dataclasses import dataclass, field

from tierfs.client import AsyncClient

__all__ = ["LiveChecker"]


@dataclass
class LiveChecker:
    meta: list[str]
    files: dict[str, bytes] = field(default_factory=dict)  # acknowledged: path -> content
    directory: str = "/live"
    writers: int = 1
    readers: int = 2
    sizes: tuple[int, int] = (16 * 1024, 96 * 1024)
    seed: int = 7
    problems: list[str] = field(default_factory=list)
    reads: int = 0
    writes: int = 0
    write_failures: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self, client: AsyncClient) -> None:
        self._client = client
        await client.mkdir(self.directory, exist_ok=True)
        for i in range(self.writers):
            self._tasks.append(asyncio.create_task(self._write(i)))
        for i in range(self.readers):
            self._tasks.append(asyncio.create_task(self._read(i)))

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _write(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        n = 0
        while not self._stop.is_set():
            data = rng.randbytes(rng.randint(*self.sizes))
            path = f"{self.directory}/w{i}-{n}"
            n += 1
            try:
                await self._client.write_bytes(path, data)
            except Exception:  # not acknowledged: nothing to check
                self.write_failures += 1
                await asyncio.sleep(0.1)
                continue
            self.files[path] = data
            self.writes += 1
            await asyncio.sleep(0.05)

    async def _read(self, i: int) -> None:
        rng = random.Random(self.seed * 2000 + i)
        while not self._stop.is_set():
            paths = list(self.files)
            rng.shuffle(paths)
            if not paths:
                await asyncio.sleep(0.05)
            for path in paths:
                if self._stop.is_set():
                    return
                want = self.files[path]
                try:
                    got = await self._client.read_bytes(path)
                except Exception as exc:
                    self.problems.append(f"{path}: read failed: {type(exc).__name__}: {exc}")
                    continue
                self.reads += 1
                if got != want:
                    self.problems.append(f"{path}: {len(got)} bytes read, sha256 {hashlib.sha256(got).hexdigest()[:12]}"
                                         f", acknowledged {len(want)} bytes {hashlib.sha256(want).hexdigest()[:12]}")

    async def verify_all(self, client: AsyncClient) -> list[str]:
        """Every acknowledged file read once more (after the checker stopped)."""
        bad = []
        for path, want in sorted(self.files.items()):
            try:
                got = await client.read_bytes(path)
            except Exception as exc:
                bad.append(f"{path}: {type(exc).__name__}: {exc}")
                continue
            if got != want:
                bad.append(f"{path}: wrong bytes")
        return bad
