"""LazyFS, the power-loss simulator: each test mounts it for real over tmp_path.

These tests prove the tool is strict enough to catch a missing fsync (unsynced
data and undurable directory entries vanish at power_loss) and faithful enough
not to lose what was properly synced.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.faults import LazyFS

pytestmark = pytest.mark.skipif(not LazyFS.available(), reason="needs /dev/fuse and fusermount3")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(path: Path, data: bytes, *, sync: bool = False, offset: int | None = None) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (0 if offset is not None else os.O_TRUNC)
    fd = os.open(path, flags, 0o644)
    try:
        os.pwrite(fd, data, offset or 0)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file (with contents) and directory (None) under root.

    Nothing is hidden: LazyFS's orphan store must neither show in the mount
    nor be left in the backing dir after power_loss() or unmount().
    """
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            out[os.path.normpath(os.path.join(rel, d))] = None
        for f in filenames:
            out[os.path.normpath(os.path.join(rel, f))] = Path(dirpath, f).read_bytes()
    return out


@pytest.mark.timeout(30)
def test_unsynced_write_is_visible_then_lost(lazy: LazyFS) -> None:
    mnt, disk = lazy.mountpoint, lazy.backing
    write(mnt / "f", b"durable", sync=True)
    fsync_dir(mnt)
    write(mnt / "f", b"DUR", offset=0)  # overwrite in place, no fsync
    write(mnt / "f", b"+tail", offset=7)  # extend, no fsync
    assert (mnt / "f").read_bytes() == b"DURable+tail"  # the page cache view
    assert os.stat(mnt / "f").st_size == 12
    assert (disk / "f").read_bytes() == b"durable"  # close() persisted nothing
    assert lazy.stats()["dirty_files"] == 1
    lazy.power_loss()
    assert (disk / "f").read_bytes() == b"durable"
    lazy.mount()
    assert (mnt / "f").read_bytes() == b"durable"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["fsync", "fdatasync"])
def test_synced_pwrites_survive(lazy: LazyFS, how: str) -> None:
    mnt, disk = lazy.mountpoint, lazy.backing
    rng = random.Random(7)
    expect = bytearray()
    fd = os.open(mnt / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for _ in range(40):  # scattered pwrites crossing page boundaries, with holes
            off = rng.randrange(0, 400_000)
            data = rng.randbytes(rng.randrange(1, 100_000))
            os.pwrite(fd, data, off)
            if len(expect) < off + len(data):
                expect.extend(bytes(off + len(data) - len(expect)))
            expect[off : off + len(data)] = data
        getattr(os, how)(fd)
        os.pwrite(fd, b"lost", 0)  # after the sync: must not survive
    finally:
        os.close(fd)
    fsync_dir(mnt)
    lazy.power_loss()
    assert (disk / "f").read_bytes() == bytes(expect)


@pytest.mark.timeout(30)
def test_new_file_needs_its_directory_fsynced(lazy: LazyFS) -> None:
    mnt, disk = lazy.mountpoint, lazy.backing
    write(mnt / "synced-data-only", b"x" * 5000, sync=True)
    lazy.power_loss()
    assert not (disk / "synced-data-only").exists()  # name was never made durable
    assert not (disk / ".lazyfs-store").exists()  # the orphan went with it

    lazy.mount()
    write(mnt / "name-only", b"unsynced data")
    fsync_dir(mnt)
    lazy.power_loss()
    assert (disk / "name-only").read_bytes() == b""  # entry durable, data not


@pytest.mark.timeout(30)
def test_atomic_replace_by_rename(lazy: LazyFS) -> None:
    mnt, disk = lazy.mountpoint, lazy.backing
    write(mnt / "cur", b"v1", sync=True)
    fsync_dir(mnt)
    for version, sync_dir in ((b"v2", False), (b"v3", True)):
        write(mnt / "cur.tmp", version, sync=True)
        os.rename(mnt / "cur.tmp", mnt / "cur")
        assert (mnt / "cur").read_bytes() == version
        if sync_dir:
            fsync_dir(mnt)
        lazy.power_loss()
        assert sorted(os.listdir(disk)) == ["cur"]
        assert (disk / "cur").read_bytes() == (version if sync_dir else b"v1")
        lazy.mount()


@pytest.mark.timeout(30)
def test_rename_across_directories(lazy: LazyFS) -> None:
    mnt, disk = lazy.mountpoint, lazy.backing
    (mnt / "a").mkdir()
    (mnt / "b").mkdir()
    write(mnt / "a" / "f", b"data", sync=True)
    for d in ("a", "b", "."):
        fsync_dir(mnt / d)
    os.rename(mnt / "a" / "f", mnt / "b" / "g")
    fsync_dir(mnt / "a")  # only the removal is durable: the file is lost
    lazy.power_loss()
    assert tree(disk) == {"a": None, "b": None}

    lazy.mount()
    write(mnt / "a" / "f", b"data", sync=True)
    fsync_dir(mnt / "a")
    os.rename(mnt / "a" / "f", mnt / "b" / "g")
    fsync_dir(mnt / "b")  # the destination carries the whole rename
    lazy.power_loss()
    assert tree(disk) == {"a": None, "b": None, "b/g": b"data"}


@pytest.mark.timeout(30)
def test_unlink_rmdir_and_mkdir_are_pending_until_dir_fsync(lazy: LazyFS) -> None:
    mnt, disk = lazy.mountpoint, lazy.backing
    (mnt / "d").mkdir()
    write(mnt / "d" / "f", b"1", sync=True)
    fsync_dir(mnt / "d")
    fsync_dir(mnt)
    os.unlink(mnt / "d" / "f")
    os.rmdir(mnt / "d")
    (mnt / "e" / "sub").mkdir(parents=True)
    write(mnt / "e" / "sub" / "g", b"2", sync=True)
    fsync_dir(mnt / "e" / "sub")
    fsync_dir(mnt / "e")  # e itself is not yet durable in the root
    assert sorted(os.listdir(mnt)) == ["e"]
    lazy.power_loss()
    assert tree(disk) == {"d": None, "d/f": b"1"}

    lazy.mount()
    os.unlink(mnt / "d" / "f")
    os.rmdir(mnt / "d")
    (mnt / "e" / "sub").mkdir(parents=True)
    write(mnt / "e" / "sub" / "g", b"2", sync=True)
    for d in ("e/sub", "e", "."):
        fsync_dir(mnt / d)
    lazy.power_loss()
    assert tree(disk) == {"e": None, "e/sub": None, "e/sub/g": b"2"}


@pytest.mark.timeout(30)
def test_type_changes_and_modes(lazy: LazyFS) -> None:
    mnt, disk = lazy.mountpoint, lazy.backing
    write(mnt / "x", b"file", sync=True)
    (mnt / "y").mkdir()
    (mnt / "m").mkdir(mode=0o755)
    write(mnt / "m" / "f", b"", sync=True)
    for d in ("m", "."):
        fsync_dir(mnt / d)
    lazy.unmount()
    lazy.mount()
    os.unlink(mnt / "x")
    (mnt / "x").mkdir()  # a file becomes a directory
    os.rmdir(mnt / "y")
    write(mnt / "y", b"now a file", sync=True)
    os.chmod(mnt / "m", 0o700)  # a directory never listed since the mount
    os.chmod(mnt / "m" / "f", 0o600)
    lazy.power_loss()
    assert tree(disk) == {"x": b"file", "y": None, "m": None, "m/f": b""}
    assert (disk / "m").stat().st_mode & 0o777 == 0o755

    lazy.mount()
    os.unlink(mnt / "x")
    (mnt / "x").mkdir()
    os.rmdir(mnt / "y")
    write(mnt / "y", b"now a file", sync=True)
    os.chmod(mnt / "m", 0o700)
    os.chmod(mnt / "m" / "f", 0o600)
    fd = os.open(mnt / "m" / "f", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    fsync_dir(mnt / "m")
    fsync_dir(mnt)
    lazy.power_loss()
    assert tree(disk) == {"x": None, "y": b"now a file", "m": None, "m/f": b""}
    assert (disk / "m").stat().st_mode & 0o777 == 0o700
    assert (disk / "m" / "f").stat().st_mode & 0o777 == 0o600


@pytest.mark.timeout(30)
def test_truncate_is_pending_until_fsync(lazy: LazyFS) -> None:
    mnt, disk = lazy.mountpoint, lazy.backing
    original = os.urandom(200_000)
    write(mnt / "f", original, sync=True)
    fsync_dir(mnt)
    fd = os.open(mnt / "f", os.O_RDWR)
    try:
        os.ftruncate(fd, 10)
        os.ftruncate(fd, 150_000)  # regrown: the cut bytes must read as zeros
        assert os.pread(fd, 150_000, 0) == original[:10] + bytes(149_990)
        os.pwrite(fd, b"Z", 100_000)
        lazy_view = os.pread(fd, 150_000, 0)
    finally:
        os.close(fd)
    lazy.power_loss()
    assert (disk / "f").read_bytes() == original
    lazy.mount()
    fd = os.open(mnt / "f", os.O_RDWR)
    try:
        os.ftruncate(fd, 10)
        os.ftruncate(fd, 150_000)
        os.pwrite(fd, b"Z", 100_000)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    lazy.power_loss()
    assert (disk / "f").read_bytes() == lazy_view


@pytest.mark.timeout(30)
def test_separate_process_acks_and_power_loss(lazy: LazyFS) -> None:
    """A writer in its own process: fsynced records survive, the rest do not,
    and after the power cut its open descriptor fails (ENOTCONN)."""
    mnt, disk = lazy.mountpoint, lazy.backing
    script = textwrap.dedent(
        """
        import os, sys
        path = sys.argv[1]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        dfd = os.open(os.path.dirname(path), os.O_RDONLY)
        os.fsync(dfd)
        for i in range(20):
            os.write(fd, b"rec%02d\\n" % i)
            os.fsync(fd)
            print("ack", i, flush=True)
        os.write(fd, b"unacked\\n")
        print("done", flush=True)
        sys.stdin.readline()
        try:
            os.write(fd, b"after\\n")
            print("wrote", flush=True)
        except OSError as e:
            print("errno", e.errno, flush=True)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(mnt / "log")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        acks = []
        for line in child.stdout:
            if line.startswith("ack"):
                acks.append(int(line.split()[1]))
            if line.startswith("done"):
                break
        assert acks == list(range(20))
        assert (mnt / "log").read_bytes().endswith(b"unacked\n")
        lazy.power_loss()
        lazy.mount()  # reboot while the child still holds a descriptor on the dead mount
        child.stdin.write("go\n")
        child.stdin.flush()
        outcome = child.stdout.readline().split()
        assert outcome[0] == "errno" and int(outcome[1]) in (errno.ENOTCONN, errno.EIO)
        assert child.wait(timeout=10) == 0
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()
    acked = b"".join(b"rec%02d\n" % i for i in range(20))
    assert (disk / "log").read_bytes() == acked
    assert (mnt / "log").read_bytes() == acked


@pytest.mark.timeout(30)
def test_o_direct_and_mmap(lazy: LazyFS) -> None:
    mnt, disk = lazy.mountpoint, lazy.backing
    buf = mmap.mmap(-1, 8192)  # page-aligned, as O_DIRECT wants
    try:
        buf.write(b"D" * 8192)
        fd = os.open(mnt / "direct", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            assert os.pwritev(fd, [buf], 0) == 8192
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        buf.close()
    write(mnt / "mapped", bytes(8192), sync=True)
    write(mnt / "mapped-unsynced", bytes(8192), sync=True)
    fsync_dir(mnt)
    for name, sync in (("mapped", True), ("mapped-unsynced", False)):
        with open(mnt / name, "r+b") as f, mmap.mmap(f.fileno(), 8192) as m:
            m[0:4] = b"MMAP"
            if sync:
                m.flush()  # msync(MS_SYNC): FUSE writes the page back, then fsyncs
    assert (mnt / "mapped-unsynced").read_bytes()[:4] == b"MMAP"
    lazy.power_loss()
    assert (disk / "direct").read_bytes() == b"D" * 8192
    assert (disk / "mapped").read_bytes()[:4] == b"MMAP"
    assert (disk / "mapped-unsynced").read_bytes() == bytes(8192)


@pytest.mark.timeout(30)
def test_clean_unmount_persists_everything(lazy: LazyFS) -> None:
    mnt, disk = lazy.mountpoint, lazy.backing
    write(mnt / "keep", b"k", sync=True)
    fsync_dir(mnt)
    (mnt / "x" / "y").mkdir(parents=True)
    write(mnt / "x" / "y" / "f", b"unsynced" * 10_000)
    write(mnt / "x" / "g", b"g")
    write(mnt / "keep", b"K", offset=0)
    write(mnt / "gone", b"z", sync=True)
    os.rename(mnt / "x" / "g", mnt / "x" / "h")
    os.unlink(mnt / "gone")
    with pytest.raises(PermissionError):
        os.mkdir(mnt / ".lazyfs-store")  # reserved: the backing dir keeps orphans there
    expect = tree(mnt)
    lazy.unmount()
    assert tree(disk) == expect
    assert not (disk / ".lazyfs-store").exists()
    lazy.mount()
    assert tree(mnt) == expect


@pytest.mark.timeout(45)
def test_random_ops_match_a_real_directory(lazy: LazyFS, tmp_path: Path) -> None:
    """Random namespace and data operations behave exactly as on the host fs,
    whatever is synced in between; a clean unmount leaves that state on disk."""
    ref = tmp_path / "ref"
    ref.mkdir()
    mnt = lazy.mountpoint
    rng = random.Random(1234)
    names = ["a", "b", "c", "d/a", "d/b", "d/e/a", "e/a"]

    def apply(r: Path, op: int, name: str, other: str, data: bytes, off: int, sync: bool) -> None:
        parent = r / os.path.dirname(name)
        if op == 0:
            write(r / name, data, offset=off, sync=sync)
        elif op == 1:
            os.rename(r / name, r / other)
        elif op == 2:
            os.unlink(r / name)
        elif op == 3:
            os.mkdir(parent if parent != r else r / "d")
        elif op == 4:
            os.truncate(r / name, off)
        elif op == 5 and parent != r:
            os.rmdir(parent)
        elif op == 6:
            fsync_dir(parent)
        elif op == 7:
            os.mkdir(r / "d" / "e")
        elif op == 8:
            os.mkdir(r / "e")

    for step in range(300):
        args = (
            rng.randrange(9),
            rng.choice(names),
            rng.choice(names),
            rng.randbytes(rng.randrange(0, 150_000)),
            rng.randrange(0, 150_000),
            rng.random() < 0.5,
        )
        outcome: list[int | None] = []
        for root in (ref, mnt):
            try:
                apply(root, *args)
                outcome.append(None)
            except OSError as exc:
                outcome.append(exc.errno)
        assert outcome[0] == outcome[1], (args[:3], outcome)
        if step % 50 == 0:
            assert tree(mnt) == tree(ref)
    assert tree(mnt) == tree(ref)
    lazy.unmount()
    assert tree(lazy.backing) == tree(ref)


@pytest.mark.timeout(30)
def test_directory_rename_moves_its_durable_contents(lazy: LazyFS) -> None:
    mnt, disk = lazy.mountpoint, lazy.backing
    (mnt / "old" / "sub").mkdir(parents=True)
    write(mnt / "old" / "sub" / "f", b"f", sync=True)
    for d in ("old/sub", "old", "."):
        fsync_dir(mnt / d)
    os.rename(mnt / "old", mnt / "new")
    write(mnt / "new" / "g", b"g", sync=True)  # g's name is never made durable
    lazy.power_loss()
    assert tree(disk) == {"old": None, "old/sub": None, "old/sub/f": b"f"}

    lazy.mount()
    os.rename(mnt / "old", mnt / "new")
    fsync_dir(mnt)
    lazy.power_loss()
    assert tree(disk) == {"new": None, "new/sub": None, "new/sub/f": b"f"}

    # A directory moved under its own former child, with only the child's
    # entries fsynced: "new" gets a durable name inside "sub" and so loses its
    # name in the root; nothing is reachable (strict, never invents data).
    lazy.mount()
    os.rename(mnt / "new" / "sub", mnt / "sub")
    os.rename(mnt / "new", mnt / "sub" / "new")
    fsync_dir(mnt / "sub")
    assert tree(mnt) == {"sub": None, "sub/f": b"f", "sub/new": None}
    lazy.power_loss()
    assert tree(disk) == {}


class Model:
    """The durability rules restated independently of the server.

    Inodes are numbers; each directory has visible and durable entries, each
    file visible and durable contents.  fsync(file) copies contents; fsync(dir)
    copies entries, and an inode that gets a durable name loses any other one.
    """

    def __init__(self) -> None:
        self.next = 1
        self.dirs: dict[int, dict[str, int]] = {0: {}}
        self.data: dict[int, bytes] = {}
        self.d_dirs: dict[int, dict[str, int]] = {0: {}}
        self.d_data: dict[int, bytes] = {}

    def new(self, is_dir: bool) -> int:
        ino, self.next = self.next, self.next + 1
        if is_dir:
            self.dirs[ino] = {}
        else:
            self.data[ino] = b""
        return ino

    def lookup(self, path: str) -> tuple[int, str, int | None]:
        parts = path.split("/")
        d = 0
        for part in parts[:-1]:
            d = self.dirs[d][part]
        return d, parts[-1], self.dirs[d].get(parts[-1])

    def fsync_dir(self, d: int) -> None:
        for name, ino in self.dirs[d].items():
            for dd, ents in self.d_dirs.items():
                for nn, ii in list(ents.items()):
                    if ii == ino and (dd, nn) != (d, name):
                        del ents[nn]
        self.d_dirs[d] = dict(self.dirs[d])

    def durable_tree(self) -> dict[str, bytes | None]:
        out: dict[str, bytes | None] = {}

        def walk(d: int, prefix: str) -> None:
            for name, ino in self.d_dirs.get(d, {}).items():
                if ino in self.dirs or ino in self.d_dirs:
                    out[prefix + name] = None
                    walk(ino, prefix + name + "/")
                else:
                    out[prefix + name] = self.d_data.get(ino, b"")

        walk(0, "")
        return out

    def rebooted(self) -> Model:
        """Power loss: a model whose whole (visible) state is this durable tree."""
        t = self.durable_tree()
        fresh = Model()
        for path in sorted(t):
            d, name, _ = fresh.lookup(path)
            content = t[path]
            ino = fresh.new(content is None)
            if content is not None:
                fresh.data[ino] = fresh.d_data[ino] = content
            fresh.dirs[d][name] = ino
        for d in fresh.dirs:
            fresh.d_dirs[d] = dict(fresh.dirs[d])
        return fresh


@pytest.mark.timeout(45)
def test_random_ops_lose_exactly_what_the_model_says(lazy: LazyFS) -> None:
    """Random writes, truncates, file and directory renames, unlinks, mkdirs,
    rmdirs and fsyncs, then power loss: the backing dir must equal the durable
    state of an independent model (checked with 30+ other seeds while writing)."""
    mnt, disk = lazy.mountpoint, lazy.backing
    rng = random.Random(99)
    model = Model()
    dirs = ["", "a/", "b/", "a/s/", "b/s/"]
    files = [d + f for d in dirs for f in ("f", "g")]
    for _cycle in range(4):
        for _ in range(150):
            op = rng.randrange(10)
            path = rng.choice(files)
            try:
                d, name, ino = model.lookup(path)
            except KeyError:
                continue  # parent dir missing
            if op == 0:  # write at an offset, maybe creating the file
                off = rng.randrange(0, 100_000)
                data = rng.randbytes(rng.randrange(1, 80_000))
                if ino is None:
                    ino = model.new(False)
                    model.dirs[d][name] = ino
                old = model.data[ino]
                old = old + bytes(max(0, off - len(old)))
                model.data[ino] = old[:off] + data + old[off + len(data) :]
                write(mnt / path, data, offset=off)
            elif op == 1 and ino is not None:
                size = rng.randrange(0, 120_000)
                model.data[ino] = model.data[ino][:size].ljust(size, b"\0")
                os.truncate(mnt / path, size)
            elif op == 2 and ino is not None:
                model.d_data[ino] = model.data[ino]
                fd = os.open(mnt / path, os.O_RDONLY)
                os.fdatasync(fd)
                os.close(fd)
            elif op == 3 and ino is not None:  # rename, maybe across dirs, maybe replacing
                try:
                    d2, name2, _ = model.lookup(rng.choice(files))
                except KeyError:
                    continue
                del model.dirs[d][name]
                model.dirs[d2][name2] = ino
                os.rename(mnt / path, mnt / (dirs_path(model, d2) + name2))
            elif op == 4 and ino is not None:
                del model.dirs[d][name]
                os.unlink(mnt / path)
            elif op == 5:  # fsync the file's directory
                model.fsync_dir(d)
                fsync_dir(mnt / path.rpartition("/")[0])
            elif op == 6:  # mkdir / rmdir a directory
                dpath = rng.choice(dirs[1:]).rstrip("/")
                try:
                    pd, dname, dino = model.lookup(dpath)
                except KeyError:
                    continue
                if dino is None:
                    model.dirs[pd][dname] = model.new(True)
                    os.mkdir(mnt / dpath)
                elif not model.dirs[dino]:
                    del model.dirs[pd][dname]
                    os.rmdir(mnt / dpath)
            elif op == 7:
                assert tree(mnt) == visible_tree(model)
            else:  # rename a directory, maybe replacing an empty one
                src, dst = rng.choice(dirs[1:]).rstrip("/"), rng.choice(dirs[1:]).rstrip("/")
                if dst == src or dst.startswith(src + "/"):
                    continue
                try:
                    pd, dname, dino = model.lookup(src)
                    pd2, dname2, dino2 = model.lookup(dst)
                except KeyError:
                    continue
                if dino is None or (dino2 is not None and model.dirs[dino2]):
                    continue
                del model.dirs[pd][dname]
                model.dirs[pd2][dname2] = dino
                os.rename(mnt / src, mnt / dst)
        assert tree(mnt) == visible_tree(model)
        lazy.power_loss()
        model = model.rebooted()
        assert tree(disk) == visible_tree(model)
        lazy.mount()


def dirs_path(model: Model, d: int) -> str:
    """The visible path prefix ("a/s/") of directory inode d."""
    if d == 0:
        return ""
    for parent, ents in model.dirs.items():
        for name, ino in ents.items():
            if ino == d:
                return dirs_path(model, parent) + name + "/"
    raise KeyError(d)


def visible_tree(model: Model) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}

    def walk(d: int, prefix: str) -> None:
        for name, ino in model.dirs[d].items():
            if ino in model.dirs:
                out[prefix + name] = None
                walk(ino, prefix + name + "/")
            else:
                out[prefix + name] = model.data[ino]

    walk(0, "")
    return out
