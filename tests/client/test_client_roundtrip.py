"""Round trips through a real six-node cluster: awkward sizes, random-offset
reads, ``readinto``/``read_into`` into numpy, sparse files, partial rewrites,
the namespace calls, and a fragment corrupted on disk."""

from __future__ import annotations

import glob
import os
import random
import struct
from typing import Any

import numpy as np
import pytest

from tests.client.util import digest, random_bytes
from tierfs.client import Client
from tierfs.client.file import AsyncFile
from tierfs.errors import (
    AlreadyExistsError,
    DirectoryNotEmptyError,
    InvalidArgumentError,
    IsADirectoryError_,
    NotFoundError,
    TierFSError,
)
from tierfs.local import LocalCluster
from tierfs.storage.api import FragmentKey

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
SIZES = [0, 1, MiB - 1, MiB, MiB + 1, 7 * MiB + 12345]


@pytest.mark.parametrize("redundancy", ["ec:4+2", "replica:3"])
def test_awkward_sizes_round_trip(client: Client, redundancy: str) -> None:
    d = f"/sizes-{redundancy.replace(':', '-').replace('+', '_')}"
    client.mkdir(d)
    client.set_layout(d, chunk_size=MiB, redundancy=redundancy)
    local = {}
    for i, n in enumerate(SIZES):
        data = random_bytes(n, seed=i)
        local[n] = data
        assert client.write_bytes(f"{d}/f{n}", data) == n
    for n, data in local.items():
        st = client.stat(f"{d}/f{n}")
        assert (st.size, st.redundancy, st.chunk_size, st.is_file) == (n, redundancy, MiB, True)
        assert digest(client.read_bytes(f"{d}/f{n}")) == digest(data)
        arr = np.zeros(n + 100, dtype=np.uint8)
        assert client.read_into(f"{d}/f{n}", arr) == n
        assert digest(arr[:n].tobytes()) == digest(data)
        assert not arr[n:].any()
    # Random-offset reads, across chunk and fragment boundaries.
    big = local[SIZES[-1]]
    rng = random.Random(7)
    with client.open(f"{d}/f{SIZES[-1]}", "rb") as f:
        for _ in range(40):
            off = rng.randrange(0, len(big) + 10)
            n = rng.choice([1, 7, 4096, MiB // 4 + 3, MiB + 17, 3 * MiB])
            f.seek(off)
            assert f.read(n) == big[off: off + n]
            assert f.tell() == min(off + n, len(big)) or off > len(big)
        f.seek(-10, os.SEEK_END)
        assert f.read() == big[-10:]
        assert f.read(5) == b""  # at EOF: short, empty
        f.seek(MiB - 3)
        out = np.empty(10, dtype=np.uint8)
        assert f.readinto(out) == 10 and out.tobytes() == big[MiB - 3: MiB + 7]
        f.seek(2 * MiB)
        floats = np.empty(1000, dtype=np.float32)  # any writable buffer type works
        assert f.readinto(floats) == 4000 and floats.tobytes() == big[2 * MiB: 2 * MiB + 4000]
    # Sequential small records (the chunk cache and its read-ahead).
    with client.open(f"{d}/f{SIZES[-1]}", "rb") as f:
        parts = []
        while rec := f.read(100_003):
            parts.append(rec)
    assert b"".join(parts) == big
    # read_into at an offset, into a numpy array
    arr = np.zeros(3 * MiB, dtype=np.uint8)
    assert client.read_into(f"{d}/f{SIZES[-1]}", arr, offset=5 * MiB) == len(big) - 5 * MiB
    assert arr[: len(big) - 5 * MiB].tobytes() == big[5 * MiB:]


def test_small_reads_out_of_order_load_each_chunk_once(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small reads that arrive a little out of order (a FUSE mount's kernel
    read-ahead: several requests in flight, up to a few chunks ahead) are
    served from the read cache, each chunk fetched once, and right."""
    cs = 64 * 1024
    client.mkdir("/ooo", exist_ok=True)
    client.set_layout("/ooo", chunk_size=cs)
    data = random_bytes(7 * cs + 100, 41)
    client.write_bytes("/ooo/f", data)
    loads: list[int] = []
    load = AsyncFile._load_chunk

    async def counted(self: AsyncFile, view: Any, idx: int, buf: memoryview) -> int:
        loads.append(idx)
        return await load(self, view, idx, buf)

    monkeypatch.setattr(AsyncFile, "_load_chunk", counted)
    with client.open("/ooo/f", "rb") as f:
        for i, c in enumerate([0, 1, 2, 1, 3, 2, 4, 2, 3, 5, 6, 4, 7, 6]):
            at = c * cs + (i * 997) % (cs - 5000)
            f.seek(at)
            assert f.read(5000) == data[at: at + 5000], (i, c)
    assert sorted(loads) == list(range(8)), loads


def test_read_caches_of_many_files_stay_within_the_client_budget(cluster: LocalCluster,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty-four files open at once, each read in small pieces: their read caches
    together never hold more than read_cache_bytes (here 6 chunks' worth),
    the least recently used chunks go first, every read is right, and a
    budget of 0 (no cache) or smaller than a chunk still reads right. A file
    smaller than a chunk takes a buffer of its own size, not a chunk's."""
    cs = 64 * 1024
    budget = 6 * cs
    peak = 0
    start = AsyncFile._start_load

    def watched(self: AsyncFile, view: Any, idx: int, keep: tuple[int, ...]) -> Any:
        nonlocal peak
        got = start(self, view, idx, keep)
        peak = max(peak, self._client.read_cache.used)
        return got

    monkeypatch.setattr(AsyncFile, "_start_load", watched)
    with Client(cluster.meta_addrs, request_timeout=5.0, read_cache_bytes=budget) as c:
        assert c._aclient is not None
        rc = c._aclient.read_cache
        c.mkdir("/budget", exist_ok=True)
        c.set_layout("/budget", chunk_size=cs)
        files = {f"/budget/f{i}": random_bytes(3 * cs + 1000 * i, 500 + i) for i in range(24)}
        files["/budget/tiny"] = random_bytes(3000, 499)
        for p, data in files.items():
            c.write_bytes(p, data)
        handles = {p: c.open(p, "rb") for p in files}
        try:
            rng = random.Random(5)
            for _ in range(400):
                p = rng.choice(list(files))
                data, f = files[p], handles[p]
                at = rng.randrange(len(data))
                f.seek(at)
                assert f.read(2000) == data[at: at + 2000], (p, at)
                assert rc.used <= budget
                # What the client's buffers really hold between calls (a
                # cancelled fetch gives its buffer back when it ends).
                assert c._aclient.pool.stats().in_use_bytes <= 2 * budget
            assert budget - cs < peak <= budget  # the budget was reached (no room for one more chunk), and held
        finally:
            for f in handles.values():
                f.close()
        assert rc.used == 0 and len(rc) == 0
        with c.open("/budget/tiny", "rb") as f:
            f.seek(10)
            assert f.read(100) == files["/budget/tiny"][10:110]
            assert rc.used == 4096  # a buffer of the file's size (a page), not a chunk's
    for limit in (0, cs // 2):
        with Client(cluster.meta_addrs, request_timeout=5.0, read_cache_bytes=limit) as c, \
                c.open("/budget/f3", "rb") as f:
            data = files["/budget/f3"]
            for at in (5, cs - 10, 2 * cs + 7, 17):
                f.seek(at)
                assert f.read(3000) == data[at: at + 3000]
            assert c._aclient is not None and c._aclient.read_cache.used == 0


def test_large_file_default_layout(client: Client) -> None:
    """A 256 MiB file with the default layout (ec:4+2, 4 MiB chunks),
    written in odd-sized pieces and read back by hash."""
    size = 256 * MiB
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
    view = data.data
    with client.open("/large.bin", "wb") as f:
        pos = 0
        step = 3 * MiB + 4097
        while pos < size:
            pos += f.write(view[pos: pos + step])
    st = client.stat("/large.bin")
    assert st.size == size and st.redundancy == "ec:4+2"
    out = np.empty(size, dtype=np.uint8)
    assert client.read_into("/large.bin", out) == size
    assert digest(out) == digest(data)


def test_sparse_files_and_rewrites(client: Client) -> None:
    client.mkdir("/sparse/deep/er", parents=True)
    client.set_layout("/sparse", chunk_size=MiB)
    p = "/sparse/deep/er/holes.bin"
    with client.open(p, "wb") as f:
        f.write(b"head")
        f.seek(3 * MiB + 100)  # chunks 1 and 2 are never written: holes
        f.write(b"middle")
        f.seek(9 * MiB)
        f.write(b"end")
    expect = bytearray(9 * MiB + 3)
    expect[:4] = b"head"
    expect[3 * MiB + 100: 3 * MiB + 106] = b"middle"
    expect[-3:] = b"end"
    assert client.read_bytes(p) == expect
    with client.open(p, "rb") as f:  # small reads inside a hole and a trimmed chunk
        f.seek(MiB + 5)
        assert f.read(10) == bytes(10)
        f.seek(3 * MiB + 200)
        assert f.read(10) == bytes(10)
    # r+b: a partial overwrite across a chunk boundary keeps the rest.
    with client.open(p, "r+b") as f:
        f.seek(MiB - 2)
        f.write(b"XYZW")
        f.seek(0)
        assert f.read(4) == b"head"  # reads see the file
        f.seek(MiB - 2)
        assert f.read(4) == b"XYZW"  # ... and this writer's own writes
    expect[MiB - 2: MiB + 2] = b"XYZW"
    assert client.read_bytes(p) == expect
    with client.open(p, "ab") as f:
        f.seek(0)  # appends go to the end regardless
        f.write(b"++")
    assert client.read_bytes(p) == expect + b"++"
    # Rewriting a chunk whose upload may still be in flight keeps its bytes.
    full = random_bytes(2 * MiB, seed=12)
    with client.open("/sparse/rewrite.bin", "wb") as f:
        f.write(full)  # two whole chunks, sent while we go on
        f.seek(10)
        f.write(b"patch")
        f.seek(MiB + 3)
        f.write(b"!")
    want = bytearray(full)
    want[10:15] = b"patch"
    want[MiB + 3] = ord("!")
    assert client.read_bytes("/sparse/rewrite.bin") == want
    # "wb" truncates: the old contents are gone, even where the new file has a hole.
    with client.open(p, "wb") as f:
        f.seek(2 * MiB)
        f.write(b"z")
    assert client.read_bytes(p) == bytes(2 * MiB) + b"z"
    with client.open(p, "rb") as f:
        assert f.read(10) == bytes(10)


def test_uncommitted_writes_are_invisible(client: Client) -> None:
    client.write_bytes("/visible.bin", b"old contents")
    f = client.open("/visible.bin", "r+b")
    try:
        f.write(random_bytes(3 * MiB, seed=3))
        f.flush()  # durable on the targets, not yet published
        assert client.read_bytes("/visible.bin") == b"old contents"
        assert client.stat("/visible.bin").writing
    finally:
        f.abort()
    assert client.read_bytes("/visible.bin") == b"old contents"
    # An exception inside the with block aborts instead of committing, and
    # a "wb" open replaces the old contents at its commit: they stay as
    # they were (until stop 45 "wb" truncated at open, and the abort left
    # an empty file: a checkpoint rewrite that failed lost the previous one).
    with pytest.raises(RuntimeError), client.open("/visible.bin", "wb") as g:
        g.write(random_bytes(5 * MiB, seed=4))
        g.flush()
        assert client.read_bytes("/visible.bin") == b"old contents"  # readers see the old contents meanwhile
        raise RuntimeError("caller failed mid-write")
    assert client.read_bytes("/visible.bin") == b"old contents"
    # committed: exactly the new contents, old chunks past them gone, holes zeros
    client.write_bytes("/visible.bin", random_bytes(9 * MiB, seed=5))
    with client.open("/visible.bin", "wb") as g:
        g.seek(5 * MiB)
        g.write(b"tail")
    assert client.read_bytes("/visible.bin") == bytes(5 * MiB) + b"tail"
    # A write that created its file and failed removes it again: the file
    # is as if never made ("xb" can be tried again). Until stop 46 it stayed,
    # empty, and a retried "xb" failed with AlreadyExistsError.
    for mode in ("xb", "wb", "ab"):
        with pytest.raises(RuntimeError), client.open(f"/made-{mode}.bin", mode) as g:
            g.write(random_bytes(5 * MiB, seed=6))
            g.flush()
            raise RuntimeError("caller failed mid-write")
        assert not client.exists(f"/made-{mode}.bin"), mode
    with client.open("/made-xb.bin", "xb") as g:
        g.write(b"second try")
    assert client.read_bytes("/made-xb.bin") == b"second try"


def test_symbolic_links_are_followed_as_the_kernel_follows_them(client: Client) -> None:
    """A link in the middle of a path (the "latest checkpoint" pattern) and
    one at its end are followed by open, read, write and ls; stat shows
    the link itself (lstat) but follows those before it. They were "not a
    directory" and "not a regular file" in the SDK (the CLI followed them)."""
    client.mkdir("/sl/ck/step2", parents=True)
    client.write_bytes("/sl/ck/step2/.metadata", b"meta2")
    client.symlink("/sl/ck/latest", "step2")
    client.symlink("/sl/ck/abs", "/sl/ck/step2/.metadata")
    client.symlink("/sl/ck/up", "../ck/latest/.metadata")
    client.symlink("/sl/ck/loop", "loop")
    client.symlink("/sl/ck/dangling", "made-later")
    assert client.readlink("/sl/ck/latest") == "step2"
    for p in ("/sl/ck/latest/.metadata", "/sl/ck/abs", "/sl/ck/up"):
        assert client.read_bytes(p) == b"meta2", p
        with client.open(p, "rb") as f:
            assert f.read() == b"meta2", p
        buf = bytearray(3)
        assert client.read_into(p, buf, 2) == 3 and buf == b"ta2", p
    assert client.ls("/sl/ck/latest") == [".metadata"]
    assert [s.path for s in client.ls("/sl/ck/latest", detail=True)] == ["/sl/ck/latest/.metadata"]
    assert client.stat("/sl/ck/latest").type == "symlink"  # the link itself
    assert client.stat("/sl/ck/latest/.metadata").size == 5
    assert client.exists("/sl/ck/latest/.metadata") and not client.exists("/sl/ck/latest/nope")
    assert client.resolve("/sl/ck/up") == "/sl/ck/step2/.metadata"
    client.write_bytes("/sl/ck/abs", b"through the link")
    assert client.read_bytes("/sl/ck/step2/.metadata") == b"through the link"
    assert client.stat("/sl/ck/abs").type == "symlink"
    with pytest.raises(InvalidArgumentError, match="too many levels of symbolic links"):
        client.read_bytes("/sl/ck/loop")
    with pytest.raises(InvalidArgumentError, match="too many levels of symbolic links"):
        client.ls("/sl/ck/loop/x")
    with pytest.raises(NotFoundError, match="/sl/ck/made-later"):
        client.read_bytes("/sl/ck/dangling")
    client.write_bytes("/sl/ck/dangling", b"new")  # as open(2) with O_CREAT: the target is made
    assert client.read_bytes("/sl/ck/made-later") == b"new"
    with pytest.raises(NotADirectoryError):  # a file in the middle of a path is still not a directory
        client.read_bytes("/sl/ck/step2/.metadata/x")
    # writing a checkpoint through the link: mkdir -p, write, rename, ls, truncate, rm
    client.mkdir("/sl/ck/latest/sub/deeper", parents=True)
    assert client.stat("/sl/ck/step2/sub/deeper").is_dir
    client.write_bytes("/sl/ck/latest/sub/.tmp", b"x" * 10)
    client.rename("/sl/ck/latest/sub/.tmp", "/sl/ck/latest/sub/final")
    client.truncate("/sl/ck/latest/sub/final", 4)
    assert client.ls("/sl/ck/latest/sub") == ["deeper", "final"]
    assert client.read_bytes("/sl/ck/step2/sub/final") == b"xxxx"
    client.rm("/sl/ck/latest/sub", recursive=True)
    assert not client.exists("/sl/ck/step2/sub")
    client.rm("/sl/ck/latest")  # the link itself, not its target
    assert client.exists("/sl/ck/step2/.metadata") and not client.exists("/sl/ck/latest")


def test_namespace(client: Client) -> None:
    client.mkdir("/ns")
    with pytest.raises(AlreadyExistsError):
        client.mkdir("/ns")
    client.mkdir("/ns", exist_ok=True)
    client.mkdir("/ns/a/b", parents=True)
    # A bad component makes nothing, not the parents before it (a new user's mkdir -p /x//y/./z).
    with pytest.raises(InvalidArgumentError, match=r"/ns/x/y/\./z: '\.' is not allowed"):
        client.mkdir("/ns/x//y/./z", parents=True)
    assert not client.exists("/ns/x")
    client.write_bytes("/ns/a/f1", b"1")
    client.write_bytes("/ns/a/b/f2", b"22")
    assert client.ls("/ns/a") == ["b", "f1"]
    assert [(s.path, s.type, s.size) for s in client.ls("/ns/a", detail=True)] == [
        ("/ns/a/b", "directory", 0), ("/ns/a/f1", "file", 1)]
    assert client.exists("/ns/a/f1") and not client.exists("/ns/nope")
    client.rename("/ns/a/f1", "/ns/f1")
    assert client.read_bytes("/ns/f1") == b"1" and not client.exists("/ns/a/f1")
    with pytest.raises(DirectoryNotEmptyError):
        client.rm("/ns/a")
    client.rm("/ns/a", recursive=True)
    assert client.ls("/ns") == ["f1"]
    client.rm("/ns/f1")
    client.rm("/ns")
    assert not client.exists("/ns")
    with pytest.raises(NotFoundError):
        client.open("/ns/missing", "rb")
    with pytest.raises(FileNotFoundError):  # the builtin works too
        client.read_bytes("/missing")
    client.mkdir("/adir")
    with pytest.raises(IsADirectoryError_):
        client.open("/adir", "rb")
    with pytest.raises(InvalidArgumentError):
        client.open("relative/path", "rb")
    with pytest.raises(InvalidArgumentError):
        client.open("/adir/x", "rt")
    client.write_bytes("/adir/x", b"x")
    with pytest.raises(AlreadyExistsError):
        client.open("/adir/x", "xb")
    with client.open("/adir/x", "rb") as f, pytest.raises(InvalidArgumentError):
        f.write(b"no")
    with pytest.raises(TierFSError):
        client.open("/adir/missing", "r+b")


def test_bad_arguments_get_clear_errors_and_change_nothing(client: Client) -> None:
    """Inputs a user can type: the root directory to ``rm -r`` (before,
    every file went and then the root's own rmdir failed), and numbers out
    of their field's range (before, protobuf's bare "Value out of range: -1",
    and a traceback from the CLI)."""
    client.mkdir("/bad/sub", parents=True)
    client.write_bytes("/bad/sub/f", b"kept")
    for root in ("/", "//", "/bad/.."):
        with pytest.raises(InvalidArgumentError, match="refusing to remove the root directory"):
            client.rm(root, recursive=True)
    assert client.read_bytes("/bad/sub/f") == b"kept"
    with pytest.raises(InvalidArgumentError, match="truncate: size -1 is out of range"):
        client.truncate("/bad/sub/f", -1)
    with pytest.raises(InvalidArgumentError, match="size 18446744073709551616 is out of range"):
        client.truncate("/bad/sub/f", 1 << 64)
    assert client.read_bytes("/bad/sub/f") == b"kept"
    with pytest.raises(InvalidArgumentError, match="chunk_size -1 is out of range"):
        client.set_layout("/bad", chunk_size=-1)
    with pytest.raises(InvalidArgumentError, match="mode -1 is out of range"):
        client.mkdir("/bad/m", mode=-1)
    assert client.ls("/bad") == ["sub"]
    # Found by a new user (stop 47): each was an InternalError, a raw
    # UnicodeEncodeError, a file made (or moved) under a name ending in '/'
    # that the same path then could not reach, "the root directory always
    # exists" for "/bad/..", or a "//" taken by mkdir -p.
    from tierfs.errors import IsADirectoryError_, NotADirectoryError_

    for mode in ("wb", "ab", "xb"):
        with pytest.raises(IsADirectoryError_, match="root directory"):
            client.open("/", mode)
    for call in (lambda: client.mkdir("/bad/\udcff"), lambda: client.stat("/bad/\udcff"),
                 lambda: client.write_bytes("/bad/\udcff", b"x")):
        with pytest.raises(InvalidArgumentError, match="not valid Unicode"):
            call()
    with pytest.raises(IsADirectoryError_, match="ending in '/'"):
        client.write_bytes("/bad/h/", b"x")
    with pytest.raises(NotADirectoryError_):
        client.rename("/bad/sub/f", "/bad/g/")
    with pytest.raises(InvalidArgumentError, match=r"'\.\.' is not allowed"):
        client.mkdir("/bad/..", exist_ok=True)
    # Repeated slashes name what one does, as in POSIX: "//bad" failed
    # "empty name" until stop 48 (a new user's find), and "/bad//z" after
    # stop 47 (it made an entry named "" before).
    client.mkdir("/bad//z", parents=True)
    assert client.ls("/bad") == ["sub", "z"] and client.ls("//bad") == ["sub", "z"]
    assert client.read_bytes("//bad//sub///f") == b"kept" and client.stat("//bad/z").is_dir
    client.rm("//bad//z", recursive=True)
    assert client.ls("/bad") == ["sub"] and client.read_bytes("/bad/sub/f") == b"kept"


def _fragment_files(cluster: LocalCluster, inode: int, chunk: int, fragment: int) -> list[str]:
    name = f"{chunk:x}.{fragment:x}.*"
    return glob.glob(str(cluster.dir / "storage-*" / "t*" / "frags" / f"{inode & 0xff:02x}" / f"{inode:016x}" / name))


def _probe(client: Client, path: str, chunk: int, frag: int) -> str:
    """What the data plane answers for one fragment of ``path``."""

    async def go() -> str:
        ac = client.aclient
        _, data, router = ac._parts()
        info = await ac.meta.stat(path)
        targets = await router.targets(info.layout.groups[chunk % len(info.layout.groups)])
        key = FragmentKey(info.attr.inode, chunk, frag, info.chunks[0].generation)
        try:
            await data.read(targets[frag], key)
        except TierFSError as exc:
            return type(exc).__name__
        return "ok"

    return client._run(go())


def test_corrupt_fragment_is_decoded_around(client: Client, cluster: LocalCluster) -> None:
    client.mkdir("/corrupt")
    client.set_layout("/corrupt", chunk_size=MiB, redundancy="ec:4+2")
    data = random_bytes(3 * MiB + 5, seed=11)
    client.write_bytes("/corrupt/f", data)
    inode = client.stat("/corrupt/f").inode
    flipped = 0
    for chunk, frag in ((0, 1), (2, 0), (2, 3)):  # chunk 2 loses two data fragments
        (path,) = _fragment_files(cluster, inode, chunk, frag)
        with open(path, "r+b") as fh:
            hdr_len = struct.unpack_from("<I", fh.read(16), 12)[0]
            fh.seek(hdr_len + 1000)
            b = fh.read(1)
            fh.seek(hdr_len + 1000)
            fh.write(bytes([b[0] ^ 0xFF]))
            fh.flush()
            os.fsync(fh.fileno())
        flipped += 1
    assert flipped == 3
    assert _probe(client, "/corrupt/f", 2, 0) == "CorruptError"  # the damage is real and seen
    assert client.read_bytes("/corrupt/f") == data
    with client.open("/corrupt/f", "rb") as f:  # ranged read touching the bad block
        f.seek(2 * MiB + 900)
        assert f.read(300) == data[2 * MiB + 900: 2 * MiB + 1200]


def test_chunk_retries_on_a_map_another_chunk_refreshed(cluster: LocalCluster) -> None:
    """A client whose cached map is stale reads a two-chunk file: chunk 0's
    (stale) targets fail at once and its retry refreshes the map; chunk 1's
    fail later, when a second refresh is rate-limited (``refresh`` says
    False). Chunk 1 must still retry: the map differs from the one its
    attempt used. (Regression: it raised InsufficientTargetsError.)"""
    import asyncio
    import socket

    from tierfs.client import AsyncClient
    from tierfs.client.client import FileView

    data = random_bytes(2 * MiB, seed=77)

    async def scenario() -> None:
        async with AsyncClient(cluster.meta_addrs, request_timeout=0.3, connect_timeout=0.5, retries=2,
                               map_refresh_interval=60.0) as ac:
            await ac.mkdir("/stale")
            await ac.set_layout("/stale", chunk_size=MiB, stripe_width=2)
            await ac.write_bytes("/stale/f", data)
            assert await ac.read_bytes("/stale/f") == data  # the map is cached now
            view = FileView.of("/stale/f", await ac.meta.stat("/stale/f"))
            g0, g1 = view.groups[0], view.groups[1]
            assert g0 != g1
            _, dc, router = ac._parts()
            width = len(router.groups[g0])
            with socket.socket() as black:  # accepts connections, never answers
                black.bind(("127.0.0.1", 0))
                black.listen(64)
                fake_slow = tuple(range(9001, 9001 + width))
                for t in fake_slow:
                    dc.set_route(t, black.getsockname())
                # Chunk 0: unroutable targets (fail at once); chunk 1: targets that time out.
                router.groups[g0] = tuple(range(9101, 9101 + width))
                router.groups[g1] = fake_slow
                router.version -= 1  # stale: meta sends the whole map on the next refresh
                router._last = -1e9  # ... which is due (the map is old), the one after is rate-limited
                assert await ac.read_bytes("/stale/f") == data
                await dc.close()  # the black-holed connections, before the socket goes

    asyncio.run(scenario())


def test_rm_recursive_goes_on_past_entries_removed_meanwhile(client: Client) -> None:
    """Another client removes files of a tree while `rm(recursive=True)`
    walks it: the walk takes an entry gone meanwhile as removed (as rm -rf
    does); until stop 47 it failed with NotFoundError on the first one."""
    import asyncio
    import contextlib

    names = [f"/rmrace/d/f{i}" for i in range(150)]
    client.mkdir("/rmrace/d", parents=True)

    async def make(ac: Any) -> None:
        await asyncio.gather(*(ac.meta.create(n) for n in names))

    async def race(ac: Any) -> list[Any]:
        async def other() -> None:
            for n in reversed(names):
                with contextlib.suppress(NotFoundError):
                    await ac.meta.unlink(n)
                await asyncio.sleep(0)

        return await asyncio.gather(ac.rm("/rmrace/d", recursive=True), other(), return_exceptions=True)

    client._run(make(client.aclient))
    out = client._run(race(client.aclient))
    assert out[0] is None, out
    assert not client.exists("/rmrace/d")


def test_small_writes_inside_a_whole_chunk_upload_it_once(client: Client) -> None:
    """Small overwrites inside a chunk that is already whole (a database's
    pages, SQLite's WAL after a checkpoint, np.memmap r+) stay staged until
    the commit: the chunk is read once and uploaded once. Before, a chunk
    loaded whole counted as full, and every such write read it back and
    uploaded it again (through the FUSE mount, 65 ms per 4 KiB pwrite into a
    4 MiB chunk; a SQLite transaction in WAL mode took 13 s instead of
    0.1 s)."""
    client.mkdir("/rmw")
    client.set_layout("/rmw", chunk_size=MiB)
    base = random_bytes(2 * MiB + 100, seed=31)
    client.write_bytes("/rmw/f", base)
    want = bytearray(base)
    with client.open("/rmw/f", "r+b") as f:
        for i in range(40):  # 4 KiB pages at odd offsets, inside chunk 0
            off = 32 + i * 4120
            page = random_bytes(4096, seed=100 + i)
            f.seek(off)
            f.write(page)
            want[off: off + 4096] = page
        f.seek(MiB - 10)  # up to chunk 0's end: uploaded there (its 2nd upload)
        f.write(b"E" * 10)
        want[MiB - 10: MiB] = b"E" * 10
        f.seek(MiB + 5)  # chunk 1 is whole too
        f.write(b"one")
        want[MiB + 5: MiB + 8] = b"one"
        f.seek(100)
        assert f.read(4096) == want[100: 4196]  # this writer's own writes
    assert client.read_bytes("/rmw/f") == want
    info = client._run(client.aclient.meta.stat("/rmw/f"))
    seqs = [rec.generation & 0xFFFFF for rec in info.chunks]  # uploads of each chunk in the session, less one
    # Chunk 0 once, at the write that reached its end (before: once per
    # write, 41 uploads); chunk 1 once, at the read's flush.
    assert seqs[:2] == [0, 0], seqs
