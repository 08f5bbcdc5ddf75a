"""A randomized file-operation exerciser in the style of fsx (the old BSD
"file system exerciser"): random writes, reads, truncates, fsyncs and
close/reopens at random offsets on a few files through ordinary syscalls,
every read checked against an in-memory model of what each file must hold.
No mmap operations.

On a mismatch it raises ``AssertionError`` naming the seed and the last
operations, so a failure can be replayed::

    python -m tests.fuse.fsx DIR --seed 7 --ops 500
"""

from __future__ import annotations

import argparse
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FsxError", "run"]


class FsxError(AssertionError):
    pass


@dataclass
class _File:
    path: Path
    fd: int
    model: bytearray = field(default_factory=bytearray)


def _check(f: _File, off: int, got: bytes, log: list[str], seed: int, what: str) -> None:
    want = bytes(f.model[off: off + len(got)]) if off < len(f.model) else b""
    if got != want:
        bad = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), min(len(got), len(want)))
        raise FsxError(f"fsx seed {seed}: {what} of {f.path.name} at {off}: {len(got)} bytes, expected "
                       f"{len(want)}; first difference at file offset {off + bad} "
                       f"(got {got[bad:bad + 8].hex()} expected {want[bad:bad + 8].hex()})\n"
                       "last operations:\n  " + "\n  ".join(log[-40:]))


def run(directory: Path, seed: int, ops: int = 300, *, files: int = 3, max_len: int = 512 * 1024,
        max_io: int = 160 * 1024) -> dict[str, bytes]:
    """Run ``ops`` random operations on ``files`` files in ``directory``.
    Files end closed; returns what each must hold (file name -> bytes), for
    the caller to check through another client."""
    rng = random.Random(seed)
    fs: list[_File] = []
    log: list[str] = []
    for i in range(files):
        p = directory / f"fsx-{seed}-{i}"
        fs.append(_File(p, os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)))
    try:
        for n in range(ops):
            f = rng.choice(fs)
            op = rng.choices(["write", "read", "truncate", "fsync", "reopen", "stat"], [40, 30, 10, 5, 10, 5])[0]
            size = len(f.model)
            if op == "write":
                off = rng.randrange(0, max_len)
                data = rng.randbytes(rng.randrange(1, max_io))
                log.append(f"{n}: write {f.path.name} off={off} len={len(data)} (size {size})")
                assert os.pwrite(f.fd, data, off) == len(data)
                if off > size:
                    f.model.extend(bytes(off - size))
                f.model[off: off + len(data)] = data
            elif op == "read":
                off = rng.randrange(0, max(1, size + 1024))
                ln = rng.randrange(1, max_io)
                log.append(f"{n}: read {f.path.name} off={off} len={ln} (size {size})")
                _check(f, off, os.pread(f.fd, ln, off), log, seed, "read")
            elif op == "truncate":
                new = rng.randrange(0, max_len)
                log.append(f"{n}: truncate {f.path.name} {size} -> {new}")
                os.ftruncate(f.fd, new)
                if new < size:
                    del f.model[new:]
                else:
                    f.model.extend(bytes(new - size))
            elif op == "fsync":
                log.append(f"{n}: fsync {f.path.name}")
                os.fsync(f.fd)
            elif op == "reopen":
                log.append(f"{n}: close+open {f.path.name}")
                os.close(f.fd)
                f.fd = -1
                f.fd = os.open(f.path, os.O_RDWR)
            else:
                log.append(f"{n}: stat {f.path.name}")
                st = os.fstat(f.fd)
                if st.st_size != size:
                    raise FsxError(f"fsx seed {seed}: fstat of {f.path.name} says {st.st_size} bytes, expected "
                                   f"{size}\nlast operations:\n  " + "\n  ".join(log[-40:]))
        for f in fs:  # a last full read of each, through a fresh descriptor
            os.close(f.fd)
            f.fd = -1
            log.append(f"end: read all of {f.path.name} ({len(f.model)} bytes)")
            _check(f, 0, f.path.read_bytes(), log, seed, "final read")
            if f.path.stat().st_size != len(f.model):
                raise FsxError(f"fsx seed {seed}: {f.path.name} is {f.path.stat().st_size} bytes at the end, "
                               f"expected {len(f.model)}")
    finally:
        for f in fs:
            if f.fd >= 0:
                os.close(f.fd)
    return {f.path.name: bytes(f.model) for f in fs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", type=Path)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ops", type=int, default=300)
    ns = ap.parse_args()
    run(ns.directory, ns.seed, ns.ops)
    print(f"fsx seed {ns.seed}: {ns.ops} operations OK")


if __name__ == "__main__":
    main()
