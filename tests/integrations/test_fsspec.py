"""``tierfs://`` (tierfs.integrations.fsspec) against a live cluster: fsspec's
own abstract test suite (copy, get, put, open, pipe), then URL forms, ranged
and random-access reads across chunk boundaries, errors, checksum/modified,
parallel ``cat``, streaming put/get, write sessions, transactions, pickling
and fork."""

from __future__ import annotations

import asyncio
import datetime
import os
import pickle
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.tests.abstract import (
    AbstractCopyTests,
    AbstractFixtures,
    AbstractGetTests,
    AbstractOpenTests,
    AbstractPipeTests,
    AbstractPutTests,
)

import tierfs.integrations.fsspec as tfs_mod
from tierfs.client import AsyncClient, Client
from tierfs.errors import ConfigError, InvalidArgumentError
from tierfs.integrations.fsspec import TierFSFileSystem
from tierfs.local import LocalCluster

pytestmark = pytest.mark.timeout(60)

CHUNK = 64 << 10  # small chunks under /small, so reads and writes cross many chunk boundaries


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cl = LocalCluster(tmp_path_factory.mktemp("fsspec-cluster"), n_storage=3)
    cl.up(timeout=90)
    with Client(cl.meta_addrs) as c:
        c.set_layout("/", redundancy="ec:2+1")
        c.mkdir("/small")
        c.set_layout("/small", chunk_size=CHUNK)
    yield cl
    cl.stop()


@pytest.fixture(scope="module")
def meta(cluster: LocalCluster) -> str:
    return ",".join(cluster.meta_addrs)


@pytest.fixture(scope="module")
def tfs(meta: str) -> Iterator[TierFSFileSystem]:
    fs = TierFSFileSystem(meta=meta, skip_instance_cache=True)
    yield fs
    fs.close()


def data(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


# ---- fsspec's abstract suite -------------------------------------------------------------


class TierFSFixtures(AbstractFixtures):  # type: ignore[misc]
    @pytest.fixture
    def fs(self, tfs: TierFSFileSystem) -> TierFSFileSystem:
        return tfs

    @pytest.fixture
    def fs_join(self) -> Any:
        return lambda *args: "/".join(args)

    @pytest.fixture
    def fs_path(self, tfs: TierFSFileSystem) -> str:
        tfs.makedirs("/abstract", exist_ok=True)
        return "/abstract"


class TestTierFSCopy(AbstractCopyTests, TierFSFixtures):  # type: ignore[misc]
    pass


class TestTierFSGet(AbstractGetTests, TierFSFixtures):  # type: ignore[misc]
    pass


class TestTierFSPut(AbstractPutTests, TierFSFixtures):  # type: ignore[misc]
    pass


class TestTierFSOpen(AbstractOpenTests, TierFSFixtures):  # type: ignore[misc]
    pass


class TestTierFSPipe(AbstractPipeTests, TierFSFixtures):  # type: ignore[misc]
    pass


# ---- registration, URLs, storage options -------------------------------------------------


def test_registered_and_url_forms(meta: str, tfs: TierFSFileSystem) -> None:
    assert fsspec.get_filesystem_class("tierfs") is TierFSFileSystem
    for url in ("tierfs://url/a/b", "tierfs:///url/a/b", "tierfs:////url//a/b/", "/url/a/b", "url/a/b"):
        assert TierFSFileSystem._strip_protocol(url) == "/url/a/b", url
    assert TierFSFileSystem._strip_protocol("tierfs://") == "/"
    fs, path = fsspec.core.url_to_fs("tierfs://url/a/b", meta=meta)
    assert isinstance(fs, TierFSFileSystem) and path == "/url/a/b"
    with fsspec.open("tierfs://url/a/b", "wb", meta=meta) as f:
        f.write(b"two slashes")
    with fsspec.open("tierfs:///url/a/b", "rb", meta=meta) as f:
        assert f.read() == b"two slashes"
    with fsspec.open("tierfs:///url/a/t.txt", "w", meta=meta) as f:  # text mode through fsspec
        f.write("héllo\n")
    assert tfs.cat_file("tierfs://url/a/t.txt") == "héllo\n".encode()
    info = tfs.info("tierfs:///url/a/b")
    assert info["name"] == "/url/a/b" and info["type"] == "file" and info["size"] == 11
    assert tfs.info("tierfs://url")["type"] == "directory"
    assert tfs.ls("tierfs:///url/a", detail=False) == ["/url/a/b", "/url/a/t.txt"]
    assert tfs.ls("/url/a/b", detail=False) == ["/url/a/b"]  # a file lists as itself
    assert tfs.unstrip_protocol("/url/a/b") == "tierfs:///url/a/b"
    assert tfs.find("/url") == ["/url/a/b", "/url/a/t.txt"]
    assert tfs.glob("tierfs:///url/*/*.txt") == ["/url/a/t.txt"]
    assert tfs.du("/url") == 11 + len("héllo\n".encode())
    assert fsspec.filesystem("tierfs", meta=meta) is fsspec.filesystem("tierfs", meta=meta)  # instance cache


def test_meta_from_env_and_config_errors(meta: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERFS_META", raising=False)
    with pytest.raises(ConfigError, match=r"'meta'.*TIERFS_META"):
        fsspec.filesystem("tierfs", skip_instance_cache=True)
    with pytest.raises(ConfigError, match="not host:port"):
        TierFSFileSystem(meta="nohostport", skip_instance_cache=True)
    with pytest.raises(ConfigError, match=r"unknown tierfs:// storage option.*'request_timout'"):
        TierFSFileSystem(meta=meta, request_timout=3, skip_instance_cache=True)
    with pytest.raises(ConfigError, match="request_timeout"):
        TierFSFileSystem(meta=meta, request_timeout=-1, skip_instance_cache=True)
    monkeypatch.setenv("TIERFS_META", meta)
    fs = TierFSFileSystem(skip_instance_cache=True, transport="tcp", timeout=4.0, meta_deadline=8)
    try:
        assert fs.config.meta == meta.split(",") and fs.config.request_timeout == 4.0
        assert fs.config.meta_deadline == 8
        fs.pipe_file("/env/f", b"via TIERFS_META")
        assert fs.cat_file("/env/f") == b"via TIERFS_META"
    finally:
        fs.close()


def test_existing_client(meta: str) -> None:
    async def main() -> None:
        async with AsyncClient(meta) as c:
            fs = TierFSFileSystem(client=c, asynchronous=True, skip_instance_cache=True)
            await fs._pipe_file("/given/x", b"on my loop")
            assert await fs._cat_file("/given/x") == b"on my loop"
            assert await c.read_bytes("/given/x") == b"on my loop"
            await fs._aclose()  # the given client stays open
            assert await c.exists("/given/x")
            with pytest.raises(ConfigError, match="client="):
                TierFSFileSystem(client=c, meta=meta, skip_instance_cache=True)

    asyncio.run(main())


def test_pickle(meta: str, tfs: TierFSFileSystem) -> None:
    tfs.pipe_file("/pickled", b"p")
    fs2 = pickle.loads(pickle.dumps(TierFSFileSystem(meta=meta, timeout=7.0, skip_instance_cache=True)))
    try:
        assert fs2.config.request_timeout == 7.0 and fs2.cat_file("/pickled") == b"p"
    finally:
        fs2.close()
    with tfs.open("/pickled", "rb") as f:
        f2 = pickle.loads(pickle.dumps(f))
        assert f2.read() == b"p"
        f2.close()


# ---- reads --------------------------------------------------------------------------------------


def test_cat_file_ranges(tfs: TierFSFileSystem) -> None:
    body = data(5 * CHUNK + 123, seed=1)
    tfs.pipe_file("/small/ranges", body)
    cases = [(None, None), (0, None), (None, 10), (10, 20), (CHUNK - 5, CHUNK + 5), (-100, None), (-100, -10),
             (None, -1), (3 * CHUNK, -CHUNK), (-10 * len(body), 5), (0, 10 * len(body)), (len(body) - 3, None),
             (len(body), None), (len(body) + 5, len(body) + 10), (20, 10), (-5, -10), (0, 0)]
    for start, end in cases:
        assert tfs.cat_file("/small/ranges", start=start, end=end) == body[start:end], (start, end)
    ranges = [(i * 1000, i * 1000 + 777) for i in range(20)]
    got = tfs.cat_ranges(["/small/ranges"] * 20, [a for a, _ in ranges], [b for _, b in ranges])
    assert got == [body[a:b] for a, b in ranges]
    assert tfs.read_block("/small/ranges", CHUNK - 1, 2) == body[CHUNK - 1: CHUNK + 1]
    assert tfs.head("/small/ranges", 7) == body[:7] and tfs.tail("/small/ranges", 7) == body[-7:]


@pytest.mark.parametrize("cache_type", ["readahead", "bytes", "blockcache", "none", "background"])
def test_random_access_reads(tfs: TierFSFileSystem, cache_type: str) -> None:
    body = data(7 * CHUNK + 1001, seed=2)
    path = f"/small/random-{cache_type}"
    tfs.pipe_file(path, body)
    rng = random.Random(3)
    with tfs.open(path, "rb", block_size=CHUNK // 3, cache_type=cache_type) as f:
        assert f.size == len(body) and f.seekable()
        for _ in range(60):
            pos = rng.randrange(len(body) + 10)
            n = rng.choice([1, 17, CHUNK // 2, CHUNK + 3, 3 * CHUNK])
            f.seek(pos)
            assert f.read(n) == body[pos: pos + n], (pos, n)
            assert f.tell() == min(pos + n, max(pos, len(body)))
        f.seek(-10, 2)
        assert f.read() == body[-10:]
        buf = bytearray(CHUNK + 7)
        f.seek(CHUNK - 3)
        assert f.readinto(buf) == len(buf) and bytes(buf) == body[CHUNK - 3: 2 * CHUNK + 4]


def test_reader_keeps_its_snapshot(tfs: TierFSFileSystem) -> None:
    """A file open for reading reads the version it opened, even when the
    file is rewritten meanwhile (or sees an error, never a mix)."""
    old, new = data(3 * CHUNK, seed=4), data(3 * CHUNK, seed=5)
    tfs.pipe_file("/small/snap", old)
    with tfs.open("/small/snap", "rb", block_size=CHUNK, cache_type="none") as f:
        assert f.read(10) == old[:10]
        tfs.pipe_file("/small/snap", new)
        f.seek(2 * CHUNK)
        assert f.read(100) == old[2 * CHUNK: 2 * CHUNK + 100]
    assert tfs.cat_file("/small/snap") == new


def test_parallel_cat(meta: str) -> None:
    """``cat`` of many paths runs their reads at once (fsspec gathers
    ``_cat_file`` in batches): all 24 are in flight together."""

    class Counting(TierFSFileSystem):
        in_flight = 0
        most = 0

        async def _cat_file(self, path: str, start: int | None = None, end: int | None = None,
                            **kwargs: Any) -> bytes:
            type(self).in_flight += 1
            type(self).most = max(type(self).most, type(self).in_flight)
            try:
                return await super()._cat_file(path, start, end, **kwargs)
            finally:
                type(self).in_flight -= 1

    fs = Counting(meta=meta, skip_instance_cache=True)
    try:
        files = {f"/par/f{i:02d}": data(1000 + i, seed=i) for i in range(24)}
        fs.pipe(files)
        assert fs.cat_file("/par/f03") == files["/par/f03"]
        Counting.most = 0
        t0 = time.monotonic()
        got = fs.cat(sorted(files))
        parallel = time.monotonic() - t0
        assert got == files
        assert Counting.most == len(files)
        assert fs.cat("/par/f0*") == {k: v for k, v in files.items() if k.startswith("/par/f0")}
        t0 = time.monotonic()
        for p in sorted(files):
            fs.cat_file(p)
        serial = time.monotonic() - t0
        print(f"cat of 24 files: {parallel * 1000:.0f} ms parallel, {serial * 1000:.0f} ms one by one")
    finally:
        fs.close()


# ---- errors -----------------------------------------------------------------------------------


def test_errors(tfs: TierFSFileSystem, tmp_path: Path) -> None:
    tfs.pipe_file("/err/file", b"x")
    for call in (lambda: tfs.info("/err/missing"), lambda: tfs.cat_file("/err/missing"),
                 lambda: tfs.cat_file("/err/missing", 1, 2), lambda: tfs.open("/err/missing", "rb"),
                 lambda: tfs.get_file("/err/missing", str(tmp_path / "m")), lambda: tfs.rm("/err/missing"),
                 lambda: tfs.ls("/err/missing"), lambda: tfs.mv("/err/missing", "/err/other"),
                 lambda: tfs.cp_file("/err/missing", "/err/other"), lambda: tfs.checksum("/err/missing")):
        with pytest.raises(FileNotFoundError):
            call()
    assert not tfs.exists("/err/missing") and not tfs.exists("/err/file/below")
    assert not tfs.isdir("/err/file") and tfs.isfile("/err/file") and not tfs.isfile("/err")
    with pytest.raises(IsADirectoryError):
        tfs.cat_file("/err")
    with pytest.raises(IsADirectoryError):
        tfs.cat_file("/err", 0, 0)
    with pytest.raises(IsADirectoryError):
        tfs.open("/err", "rb")
    with pytest.raises(NotADirectoryError):
        tfs.pipe_file("/err/file/below", b"y")
    with pytest.raises(FileExistsError):
        tfs.mkdir("/err")
    with pytest.raises(FileExistsError):
        tfs.makedirs("/err")
    tfs.makedirs("/err", exist_ok=True)
    with pytest.raises(FileExistsError):
        tfs.makedirs("/err/file", exist_ok=True)
    with pytest.raises(FileNotFoundError):
        tfs.mkdir("/err/no/parent", create_parents=False)
    with pytest.raises(FileExistsError):
        tfs.pipe_file("/err/file", b"z", mode="create")
    with pytest.raises(OSError, match="not empty"):
        tfs.rm("/err")  # a non-empty directory without recursive
    with pytest.raises(OSError, match="not empty"):
        tfs.rmdir("/err")
    with pytest.raises(NotADirectoryError):
        tfs.rmdir("/err/file")
    with pytest.raises(ValueError, match="modes"):
        tfs.open("/err/file", "r+b")
    assert tfs.cat_file("/err/file") == b"x"  # none of that changed anything


def test_symbolic_links(tfs: TierFSFileSystem) -> None:
    """A "latest" link to a checkpoint directory: read through, listed
    through, and info() reports the target's type and size with islink and
    destination, as fsspec's local filesystem does (it said type "other",
    and reads through it were "not a directory")."""
    tfs.pipe_file("/links/step7/.metadata", b"seven")
    c = tfs._run(tfs._get_client())
    tfs._run(c.symlink("/links/latest", "step7"))
    tfs._run(c.symlink("/links/dangling", "nothing"))
    assert tfs.cat_file("/links/latest/.metadata") == b"seven"
    with tfs.open("/links/latest/.metadata", "rb") as f:
        assert f.read() == b"seven"
    assert tfs.ls("/links/latest", detail=False) == ["/links/latest/.metadata"]
    info = tfs.info("/links/latest")
    assert (info["type"], info["islink"], info["destination"]) == ("directory", True, "step7"), info
    assert tfs.isdir("/links/latest") and tfs.info("/links/latest/.metadata")["size"] == 5
    dang = tfs.info("/links/dangling")
    assert (dang["type"], dang["islink"], dang["destination"]) == ("other", True, "nothing"), dang


def test_checksum_and_modified(tfs: TierFSFileSystem) -> None:
    t0 = datetime.datetime.now(datetime.UTC)
    tfs.pipe_file("/ck/a", b"same bytes")
    c1 = tfs.checksum("/ck/a")
    assert c1 == tfs.checksum("tierfs:///ck/a")
    tfs.pipe_file("/ck/b", b"same bytes")
    assert tfs.checksum("/ck/b") != c1  # another file
    tfs.pipe_file("/ck/a", b"same bytes")  # rewritten: a new version, even with equal bytes
    c2 = tfs.checksum("/ck/a")
    assert c2 != c1
    with tfs.open("/ck/a", "ab") as f:
        f.write(b"!")
    assert tfs.checksum("/ck/a") not in (c1, c2)
    m = tfs.modified("/ck/a")
    assert m.tzinfo is not None and t0 - datetime.timedelta(seconds=5) <= m <= \
        datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=5)
    assert tfs.info("/ck/a")["mtime"] == pytest.approx(m.timestamp(), abs=1e-5)
    with pytest.raises(NotImplementedError):
        tfs.created("/ck/a")


# ---- writes ------------------------------------------------------------------------------------


def test_open_write_modes(tfs: TierFSFileSystem) -> None:
    body = data(3 * CHUNK + 5, seed=6)
    with tfs.open("/small/w/deep/f", "wb", block_size=CHUNK // 4) as f:  # parents made (auto_mkdir)
        for off in range(0, len(body), 10_000):
            f.write(body[off: off + 10_000])
        assert f.tell() == len(body)
    assert tfs.cat_file("/small/w/deep/f") == body
    with tfs.open("/small/w/deep/f", "ab") as f:
        assert f.tell() == len(body)
        f.write(b"tail")
    assert tfs.cat_file("/small/w/deep/f") == body + b"tail"
    with pytest.raises(FileExistsError):
        tfs.open("/small/w/deep/f", "xb")
    with tfs.open("/small/w/x", "xb") as f:
        f.write(b"exclusive")
    assert tfs.cat_file("/small/w/x") == b"exclusive"
    # An exception inside the block aborts: nothing of the write becomes visible.
    with pytest.raises(RuntimeError), tfs.open("/small/w/aborted", "wb", block_size=CHUNK) as f:
        f.write(data(2 * CHUNK))
        f.flush()
        raise RuntimeError("boom")
    assert not tfs.exists("/small/w/aborted")  # the file it created is gone again (empty until stop 46)
    with pytest.raises(RuntimeError), tfs.open("/small/w/x", "ab") as f:
        f.write(b" more")
        raise RuntimeError("boom")
    assert tfs.cat_file("/small/w/x") == b"exclusive"


def test_transaction(tfs: TierFSFileSystem) -> None:
    with tfs.transaction:
        with tfs.open("/txn/a", "wb") as f:
            f.write(b"committed at the end")
        assert tfs.cat_file("/txn/a") == b""  # closed but not yet published
    assert tfs.cat_file("/txn/a") == b"committed at the end"
    with pytest.raises(RuntimeError), tfs.transaction:
        with tfs.open("/txn/b", "wb") as f:
            f.write(b"discarded")
        raise RuntimeError("boom")
    assert not tfs.exists("/txn/b")  # discarded: the file it created is gone again (empty until stop 46)
    # a rewrite in a transaction that fails leaves the file as it was (it
    # was emptied: "wb" truncated at open until stop 45)
    tfs.pipe_file("/txn/precious", b"PRECIOUS DATA")
    with pytest.raises(RuntimeError), tfs.transaction:
        with tfs.open("/txn/precious", "wb") as f:
            f.write(b"new")
        assert tfs.cat_file("/txn/precious") == b"PRECIOUS DATA"
        raise RuntimeError("boom")
    assert tfs.cat_file("/txn/precious") == b"PRECIOUS DATA"
    with pytest.raises(RuntimeError), tfs.open("/txn/precious", "wb") as f:
        f.write(data(3 * CHUNK))
        f.flush()
        raise RuntimeError("boom")
    assert tfs.cat_file("/txn/precious") == b"PRECIOUS DATA"
    with tfs.transaction, tfs.open("/txn/precious", "wb") as f:
        f.write(b"replaced")
    assert tfs.cat_file("/txn/precious") == b"replaced"


def test_put_get_streaming(tfs: TierFSFileSystem, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """put_file / get_file move a block at a time (here 48 KiB blocks over
    64 KiB chunks): never the whole file in memory."""
    monkeypatch.setattr(tfs_mod, "STREAM_BLOCK", 48 << 10)
    body = data(20 * CHUNK + 77, seed=7)
    src = tmp_path / "src.bin"
    src.write_bytes(body)
    seen: list[int] = []

    class CB(fsspec.callbacks.Callback):  # type: ignore[misc]
        def call(self, *args: Any, **kwargs: Any) -> None:
            seen.append(self.value)

    tfs.put_file(str(src), "/small/pg/f.bin", callback=CB())
    assert tfs.cat_file("/small/pg/f.bin") == body
    assert seen[-1] == len(body) and len(seen) >= len(body) // (48 << 10)
    dst = tmp_path / "out" / "f.bin"
    tfs.get_file("/small/pg/f.bin", str(dst))
    assert dst.read_bytes() == body
    tfs.cp_file("/small/pg/f.bin", "/small/pg/copy/f.bin")
    assert tfs.cat_file("/small/pg/copy/f.bin") == body
    with pytest.raises(FileExistsError):
        tfs.put_file(str(src), "/small/pg/f.bin", mode="create")
    import io

    out = io.BytesIO()
    tfs.get_file("/small/pg/f.bin", out)
    assert out.getvalue() == body


def test_mv_rm_and_trees(tfs: TierFSFileSystem) -> None:
    tfs.pipe({f"/tree/d{i}/sub/f{j}": b"%d" % j for i in range(3) for j in range(12)})
    tfs.pipe_file("/tree/top", b"t")
    tfs.mv("/tree/top", "/tree/renamed")
    assert not tfs.exists("/tree/top") and tfs.cat_file("/tree/renamed") == b"t"
    tfs.mv("/tree/renamed", "/tree/d0")  # into an existing directory
    assert tfs.cat_file("/tree/d0/renamed") == b"t"
    tfs.mv("/tree/d1", "/tree/moved/d1", recursive=True)  # a directory, whole, parents made
    assert len(tfs.find("/tree/moved/d1")) == 12 and not tfs.exists("/tree/d1")
    tfs.rename("/tree/moved", "/tree/again")
    assert tfs.isdir("/tree/again/d1/sub")
    # Into its own subtree, through parents that do not exist: refused, and
    # none of them made (they were, until stop 47).
    from tierfs.errors import InvalidRenameError

    with pytest.raises(InvalidRenameError, match="own subtree"):
        tfs.mv("/tree/again", "/tree/again/d1/new/deeper/x")
    assert not tfs.exists("/tree/again/d1/new") and tfs.isdir("/tree/again/d1/sub")
    tfs.rm("/tree/d0/sub/f0")
    tfs.rm(["/tree/d0/sub/f1", "/tree/d0/sub/f2"])
    assert len(tfs.ls("/tree/d0/sub")) == 9
    tfs.rm("/tree/d0/sub/f1*")  # f10, f11
    assert len(tfs.ls("/tree/d0/sub")) == 7
    tfs.rm("/tree", recursive=True)
    assert not tfs.exists("/tree")
    tfs.pipe({f"/deep/a/b/c{i}": b"" for i in range(3)})
    tfs.rm("/deep/a/b", recursive=True, maxdepth=1)
    assert tfs.ls("/deep/a", detail=False) == []
    tfs.rm("/deep", recursive=True)
    # The root, alone or among others: refused before anything goes.
    tfs.pipe({"/keep/f": b"kept"})
    for root in ("tierfs:///", "/", ["/keep/f", "/"]):
        with pytest.raises(InvalidArgumentError, match="refusing to remove the root directory"):
            tfs.rm(root, recursive=True)
    assert tfs.cat("/keep/f") == b"kept"
    tfs.rm("/keep", recursive=True)


# ---- processes ---------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_fork(meta: str) -> None:
    """A filesystem used in the parent works in a forked child (its own
    loop and client there) and in the parent afterwards; a child's
    ``fsspec.filesystem`` is a new instance (fsspec's cache is per process)."""
    fs = fsspec.filesystem("tierfs", meta=meta)
    fs.pipe_file("/fork/parent", b"from the parent")
    assert fs.cat_file("/fork/parent") == b"from the parent"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ok = fs.cat_file("/fork/parent") == b"from the parent"
            fs.pipe_file("/fork/child", b"from the child")
            fresh = fsspec.filesystem("tierfs", meta=meta)
            if ok and fresh is not fs and fresh.cat_file("/fork/child") == b"from the child":
                code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 40
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    assert fs.cat_file("/fork/child") == b"from the child"


def test_clean_exit(meta: str) -> None:
    """A process that used tierfs:// and exits without closing anything
    exits at once and quietly (no warnings in development mode); the exit
    hook closes the client the filesystem made (run here by hand, then again
    by the interpreter)."""
    code = ("import fsspec, tierfs.integrations.fsspec as m\n"
            "fs = fsspec.filesystem('tierfs')\n"
            "fs.pipe_file('/exit/f', b'bye')\n"
            "f = fs.open('/exit/f', 'rb')\n"  # left open
            "assert f.read(1) == b'b'\n"
            "c = fs._client\n"
            "m._at_exit()\n"
            "assert c._closed and fs._client is None\n")
    env = dict(os.environ, TIERFS_META=meta, PYTHONPATH=os.getcwd())
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-X", "dev", "-W", "error", "-c", code], env=env, capture_output=True,
                       text=True, timeout=40)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    assert time.monotonic() - t0 < 30
