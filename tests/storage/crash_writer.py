"""Child process of test_crash: writes fragments forever, printing an ACK line
after each write returns. ``python crash_writer.py ROOT BACKEND FIRST_INODE``."""

from __future__ import annotations

import asyncio
import random
import sys

from tierfs.buffers import BufferPool
from tierfs.storage.api import FragmentKey
from tierfs.storage.engine import ChunkEngine, crc32c
from tierfs.storage.io import open_backend


def payload(seed: int) -> bytes:
    rng = random.Random(seed)
    return rng.randbytes(rng.choice([0, 1, 4095, 4097, 70_000, 300_000, 1 << 20, (2 << 20) + 5]))


async def main(root: str, kind: str, first: int) -> None:
    pool = BufferPool(64 << 20)
    be = open_backend(kind, pool, queue_depth=16)
    eng = ChunkEngine(root, 1, be, pool)
    await eng.open()
    print("READY", flush=True)
    counter = iter(range(first, 1 << 40))

    async def writer() -> None:
        while True:
            seed = next(counter)
            data = payload(seed)
            await eng.write(FragmentKey(seed, seed % 7, seed % 3, 1), memoryview(data), crc32c(data))
            sys.stdout.write(f"ACK {seed}\n")
            sys.stdout.flush()

    await asyncio.gather(*(writer() for _ in range(8)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
