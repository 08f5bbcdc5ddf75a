"""``tierfs mount`` over a real cluster: coreutils, Python ``open()``, an
fsx-style randomized exerciser, git, metadata (chmod, utimens, stat), and
unmounting by SIGTERM and ``tierfs umount``. One cluster and one
daemon-mode mount (the real command, a subprocess) for the module; the test
directory has 64 KiB chunks so small files cross chunk boundaries."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.client.util import random_bytes
from tests.fuse.conftest import CHUNK
from tests.fuse.fsx import run as fsx_run
from tests.fuse.util import REPO, Mount, run_tierfs, wait_gone, wait_unmounted
from tierfs.cli.main import run as cli_run
from tierfs.client import Client
from tierfs.fuse import find_mount
from tierfs.local import LocalCluster, free_ports

if not (os.path.exists("/dev/fuse") and shutil.which("fusermount3")):
    pytest.skip("needs /dev/fuse and fusermount3", allow_module_level=True)

SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 123, 16 * CHUNK + 17]


def _sh(*cmd: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=cwd, env=env)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}): {r.stderr}"
    return r.stdout


def _wait(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not callable(cond) or not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_coreutils_cp_dd_sha256_find_mv(mnt: Path, client: Client, tmp_path: Path) -> None:
    d = mnt / "t" / "coreutils"
    d.mkdir()
    local = tmp_path / "src"
    local.mkdir()
    want: dict[str, str] = {}
    for i, n in enumerate(SIZES):
        data = random_bytes(n, i) if n else b""
        (local / f"f{n}").write_bytes(data)
        want[f"f{n}"] = hashlib.sha256(data).hexdigest()
    # cp in, dd in (1 MiB blocks and odd 7 KiB blocks), sha256sum over the mount.
    _sh("cp", "-r", str(local), str(d / "cp"))
    (d / "dd").mkdir()
    for n in SIZES:
        bs = "1M" if n % 2 else "7K"
        _sh("dd", f"if={local / f'f{n}'}", f"of={d / 'dd' / f'f{n}'}", f"bs={bs}", "status=none")
    for sub in ("cp", "dd"):
        out = _sh("sha256sum", *[f"f{n}" for n in SIZES], cwd=d / sub)
        got = {line.split()[1]: line.split()[0] for line in out.splitlines()}
        assert got == want, sub
        # Closed files are durable and visible to another client at once.
        for n in SIZES:
            assert hashlib.sha256(client.read_bytes(f"/t/coreutils/{sub}/f{n}")).hexdigest() == want[f"f{n}"]
    # cp over an existing, longer file (O_TRUNC).
    big = 16 * CHUNK + 17
    _sh("cp", str(local / "f1"), str(d / "cp" / f"f{5 * CHUNK + 123}"))
    assert client.read_bytes(f"/t/coreutils/cp/f{5 * CHUNK + 123}") == (local / "f1").read_bytes()
    _sh("cp", str(local / f"f{5 * CHUNK + 123}"), str(d / "cp" / f"f{5 * CHUNK + 123}"))
    # dd out with odd reads and an offset; cp back out.
    part = _sh_bytes("dd", f"if={d / 'dd' / f'f{big}'}", "bs=3000", "skip=7", "count=100", "status=none")
    assert part == (local / f"f{big}").read_bytes()[21000: 321000]
    _sh("cp", str(d / "cp" / f"f{big}"), str(tmp_path / "back"))
    assert (tmp_path / "back").read_bytes() == (local / f"f{big}").read_bytes()
    # mv within a directory, across directories, over an existing file.
    _sh("mv", str(d / "cp" / "f1"), str(d / "cp" / "renamed"))
    _sh("mv", str(d / "cp" / "renamed"), str(d / "dd" / f"f{CHUNK}"))
    assert (d / "dd" / f"f{CHUNK}").read_bytes() == (local / "f1").read_bytes()
    _sh("mv", str(d / "dd"), str(d / "moved"))
    found = sorted(_sh("find", str(d), "-type", "f").split())
    assert found == sorted([str(d / "cp" / f"f{n}") for n in SIZES if n != 1]
                           + [str(d / "moved" / f"f{n}") for n in SIZES])
    assert sorted(client.ls("/t/coreutils/moved")) == sorted(f"f{n}" for n in SIZES)
    _sh("rm", "-r", str(d / "moved"))
    assert not client.exists("/t/coreutils/moved")


def _sh_bytes(*cmd: str) -> bytes:
    r = subprocess.run(cmd, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.timeout(60)
def test_python_open_modes(mnt: Path, client: Client) -> None:
    d = mnt / "t" / "py"
    d.mkdir()
    p = d / "x.bin"
    data = random_bytes(3 * CHUNK + 5, 1)
    with open(p, "wb") as f:
        f.write(data)
    assert os.stat(p).st_size == len(data)
    with open(p, "rb") as f:
        f.seek(CHUNK - 3)
        assert f.read(10) == data[CHUNK - 3: CHUNK + 7]
    with open(p, "r+b") as f:  # random writes over existing data, one across a chunk boundary
        f.seek(CHUNK - 2)
        f.write(b"ABCD")
        f.seek(10)
        f.write(b"xy")
        f.seek(CHUNK - 4)
        assert f.read(8) == data[CHUNK - 4: CHUNK - 2] + b"ABCD" + data[CHUNK + 2: CHUNK + 4]
    exp = bytearray(data)
    exp[CHUNK - 2: CHUNK + 2] = b"ABCD"
    exp[10:12] = b"xy"
    with open(p, "ab") as f:
        f.write(b"tail")
    exp += b"tail"
    assert p.read_bytes() == bytes(exp)
    assert client.read_bytes("/t/py/x.bin") == bytes(exp)
    # Writing past the end leaves a hole that reads as zeros.
    with open(p, "r+b") as f:
        f.seek(len(exp) + 2 * CHUNK)
        f.write(b"Z")
    exp += bytes(2 * CHUNK) + b"Z"
    assert p.read_bytes() == bytes(exp)
    # O_EXCL, and the errors applications rely on.
    with pytest.raises(FileExistsError):
        os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with pytest.raises(FileNotFoundError):
        os.open(d / "absent", os.O_RDONLY)
    with pytest.raises(IsADirectoryError):
        os.open(d, os.O_WRONLY)
    os.mkdir(d / "sub")
    (d / "sub" / "f").write_bytes(b"1")
    with pytest.raises(OSError, match="not empty"):
        os.rmdir(d / "sub")
    os.unlink(d / "sub" / "f")
    os.rmdir(d / "sub")
    assert sorted(os.listdir(d)) == ["x.bin"]
    # `ls -a` lists "." and ".." with their inode numbers (they were absent
    # until stop 47); os.listdir leaves them out itself.
    out = subprocess.run(["ls", "-ai", str(d)], capture_output=True, text=True, timeout=30, check=True).stdout
    ino = {line.split()[1]: int(line.split()[0]) for line in out.splitlines()}
    assert sorted(ino) == [".", "..", "x.bin"], out
    assert ino["."] == d.stat().st_ino and ino[".."] == d.parent.stat().st_ino, (out, d.stat().st_ino)
    assert ino["x.bin"] == p.stat().st_ino
    root = subprocess.run(["ls", "-ai", str(mnt)], capture_output=True, text=True, timeout=30, check=True).stdout
    assert {ln.split()[1] for ln in root.splitlines()} >= {".", "..", "t"}, root


@pytest.mark.timeout(60)
def test_close_and_fsync_make_data_durable(mnt: Path, client: Client) -> None:
    d = mnt / "t" / "durable"
    d.mkdir()
    p = d / "f"
    data = random_bytes(2 * CHUNK + 9, 5)
    # fsync: published while the descriptor stays open.
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
        assert client.read_bytes("/t/durable/f") == data
        os.write(fd, b"more")
        os.fsync(fd)
        assert client.read_bytes("/t/durable/f") == data + b"more"
    finally:
        os.close(fd)
    # While a write session is open, the mtime is the last write's, as on a
    # local file (it stayed at the last commit's until close, until stop 47).
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        before = os.fstat(fd).st_mtime_ns
        t0 = time.time_ns()
        os.write(fd, b"x")
        deadline = time.monotonic() + 10  # the kernel's cached attributes expire (attr_timeout)
        while os.fstat(fd).st_mtime_ns < t0:
            assert time.monotonic() < deadline, (before, os.fstat(fd).st_mtime_ns, t0)
            time.sleep(0.05)
    finally:
        os.close(fd)
    # close: published by the close itself, not by the release of the last
    # descriptor (another one stays open here).
    keep = os.open(p, os.O_RDONLY)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
        os.write(fd, b"replaced")
        os.close(fd)
        assert client.read_bytes("/t/durable/f") == b"replaced"
        assert os.pread(keep, 100, 0) == b"replaced"
    finally:
        os.close(keep)


@pytest.mark.timeout(60)
def test_a_descriptor_reads_on_after_its_file_is_removed(mnt: Path, client: Client) -> None:
    """An open descriptor goes on reading its snapshot after the file is
    unlinked here or replaced by another client, also once the kernel's
    cached attributes expired (attr_timeout, 1 s) and it asks getattr again
    before each read: until stop 47 that getattr's ENOENT failed the reads
    and fstat. Non-UTF-8 names: ENOENT for a lookup, EILSEQ for a create
    (it was EIO and a logged traceback)."""
    d = mnt / "t" / "gone"
    d.mkdir()
    data = random_bytes(5 * CHUNK + 17, 47)
    for how in ("unlink", "replace"):
        p = d / how
        p.write_bytes(data)
        fd = os.open(p, os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, 0) == data[:4096]
            if how == "unlink":
                os.unlink(p)
            else:
                client.write_bytes("/t/gone/new", b"new")  # another client renames a new file over it
                client.rename("/t/gone/new", f"/t/gone/{how}")
            # Across several attr_timeouts: every read must be served.
            end = time.monotonic() + 3.5
            while time.monotonic() < end:
                for off in (4096, 3 * CHUNK + 5, len(data) - 100):
                    assert os.pread(fd, 4096, off) == data[off:off + 4096], (how, off)
                st = os.fstat(fd)
                assert st.st_size == len(data), (how, st)
            if how == "unlink":
                assert os.fstat(fd).st_nlink == 0
        finally:
            os.close(fd)
    assert sorted(os.listdir(d)) == ["replace"] and (d / "replace").read_bytes() == b"new"
    bad = os.fsencode(str(d)) + b"/bad\xff\xfe"
    with pytest.raises(FileNotFoundError):
        os.stat(bad)
    with pytest.raises(OSError) as ei:
        os.open(bad, os.O_WRONLY | os.O_CREAT, 0o644)
    assert ei.value.errno == errno.EILSEQ, ei.value
    with pytest.raises(OSError) as ei:
        os.mkdir(bad)
    assert ei.value.errno == errno.EILSEQ, ei.value


@pytest.mark.timeout(60)
def test_a_file_unlinked_while_open_here_stays_usable(mnt: Path, client: Client) -> None:
    """The temporary-file pattern: open, unlink, then write and read through
    the descriptor (Python's ``tempfile.TemporaryFile`` falls back to it, as
    FUSE has no O_TMPFILE). The mount renames such a file to a hidden name
    and removes it at the last close; until stop 48 the first write failed
    with ENOENT."""
    import tempfile

    from tierfs.fuse.ops import SILLY_PREFIX

    d = mnt / "t" / "silly"
    d.mkdir()
    data = random_bytes(3 * CHUNK + 5, 48)
    with tempfile.TemporaryFile(dir=d) as f:
        f.write(data)
        f.flush()
        f.seek(0)
        assert f.read() == data
        names = os.listdir(d)
        assert len(names) == 1 and names[0].startswith(SILLY_PREFIX), names
        assert os.fstat(f.fileno()).st_nlink == 0
        time.sleep(1.2)  # past attr_timeout: the kernel asks getattr again, and reads go on
        f.seek(CHUNK)
        f.write(b"middle")
        f.seek(0)
        want = data[:CHUNK] + b"middle" + data[CHUNK + 6:]
        assert f.read() == want
    _wait(lambda: os.listdir(d) == [], 10, "the hidden name to go at the last close")
    # Written, unlinked, written again, read through a second descriptor of it.
    p = d / "log"
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"first ")
        other = os.open(p, os.O_RDONLY)
        os.unlink(p)
        assert not p.exists()
        os.write(fd, b"second")
        os.fsync(fd)
        assert os.pread(other, 100, 0) == b"first second"
        os.close(other)
        assert os.listdir(d)  # one descriptor still open: the hidden name stays
    finally:
        os.close(fd)
    _wait(lambda: os.listdir(d) == [], 10, "the hidden name to go at the last close")
    assert client.ls("/t/silly") == []
    # A file not open here is unlinked at once, as before.
    (d / "plain").write_bytes(b"x")
    os.unlink(d / "plain")
    assert os.listdir(d) == []
    # rm -r of a directory holding one: its hidden name is busy (EBUSY, as
    # NFS answers), not renamed again and again, and rm says which file.
    sub = d / "sub"
    sub.mkdir()
    fd = os.open(sub / "held", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"held")
        os.unlink(sub / "held")
        (hidden,) = os.listdir(sub)
        r = subprocess.run(["rm", "-rf", str(sub)], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and f"{hidden}': Device or resource busy" in r.stderr, r.stderr
        assert os.listdir(sub) == [hidden]
        assert os.pread(fd, 10, 0) == b"held"
    finally:
        os.close(fd)
    _wait(lambda: os.listdir(sub) == [], 10, "the hidden name to go at the last close")
    os.rmdir(sub)


_APPENDER = """
import os, sys
path, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for j in range(n):  # open, append one line, close: as many loggers do
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{tag} line {j:05d}\\n".encode())
    os.close(fd)
"""


@pytest.mark.timeout(120)
def test_applications_other_processes_and_clients(mnt: Path, client: Client, tmp_path: Path) -> None:
    """Found by a new user's applications (stop 47):
    - two processes appending (open O_APPEND, write, close) to one log lost
      lines: a getattr during a commit gave the kernel the size from before
      it, and the next append went over the line just committed;
    - a path replaced by another client's rename (write-then-rename)
      failed an open with ENOENT: the kernel's dentry named the old inode
      (now ESTALE, and the kernel looks the name up again);
    - a new open read a file another client had rewritten larger only up to
      the size the kernel last had (no error);
    - statfs counted capacity minus use, not what the disks have free."""
    d = mnt / "t" / "apps"
    d.mkdir()
    log = d / "log"
    procs = [subprocess.Popen([sys.executable, "-c", _APPENDER, str(log), tag, "60"]) for tag in ("a", "b", "c")]
    assert [p.wait(90) for p in procs] == [0, 0, 0]
    lines = log.read_bytes().splitlines()
    assert sorted(lines) == sorted(f"{t} line {j:05d}".encode() for t in "abc" for j in range(60)), len(lines)

    # write-then-rename by another client while this mount opens the path
    client.write_bytes("/t/apps/cfg", b"v0" * 100)
    assert (d / "cfg").read_bytes() == b"v0" * 100
    errors = 0
    for i in range(1, 25):
        client.write_bytes("/t/apps/cfg.tmp", b"v%d" % i * 100)
        client.rename("/t/apps/cfg.tmp", "/t/apps/cfg")
        try:
            got = (d / "cfg").read_bytes()
        except FileNotFoundError:
            errors += 1
            continue
        assert got == b"v%d" % i * 100, (i, got[:10])
    assert errors == 0

    # close-to-open: a new open reads what another client's close left
    f = d / "grow"
    for i in range(6):
        f.stat() if i else None  # the kernel holds the size it was told
        data = random_bytes(200_000 if i % 2 == 0 else 3000, 60 + i)
        client.write_bytes("/t/apps/grow", data)
        fd = os.open(f, os.O_RDONLY)
        got = b""
        try:
            while chunk := os.read(fd, 1 << 16):
                got += chunk
        finally:
            os.close(fd)
        assert got == data, (i, len(got), len(data))

    # statfs: free space as `tierfs df` counts it
    import asyncio

    from tierfs.cli.usage import df

    st = os.statvfs(mnt)
    rep = asyncio.run(df(client.config.meta))
    free = sum(t["free"] for t in rep["targets"])
    assert abs(st.f_bavail * st.f_frsize - free) <= max(free // 20, 64 << 20), (st.f_bavail * st.f_frsize, free)


@pytest.mark.timeout(60)
def test_fsx_random_operations(mnt: Path, client: Client) -> None:
    d = mnt / "t" / "fsx"
    d.mkdir()
    for seed in (1, 2):
        final = fsx_run(d, seed, ops=100, files=3, max_len=6 * CHUNK, max_io=2 * CHUNK + 100)
        for name, want in final.items():  # and through another client
            assert client.read_bytes(f"/t/fsx/{name}") == want, f"seed {seed}: {name} differs through the SDK"


@pytest.mark.timeout(60)
def test_git_init_add_commit(mnt: Path) -> None:
    repo = mnt / "t" / "repo"
    repo.mkdir()
    (repo / "src").mkdir()
    for i in range(4):
        (repo / "src" / f"m{i}.py").write_text(f"print({i})\n" * (i * 1000 + 1))
    (repo / "README").write_text("hello\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com", "HOME": str(repo),
           "GIT_CONFIG_NOSYSTEM": "1"}
    # No template: the sample hooks git would copy are a dozen more files to create.
    _sh("git", "init", "-q", "--template=", cwd=repo, env=env)
    _sh("git", "add", "-A", cwd=repo, env=env)
    _sh("git", "commit", "-qm", "first", cwd=repo, env=env)
    assert _sh("git", "log", "--format=%s", cwd=repo, env=env).split() == ["first"]
    assert _sh("git", "status", "--porcelain", cwd=repo, env=env) == ""
    assert _sh("git", "ls-files", cwd=repo, env=env).split() == ["README"] + [f"src/m{i}.py" for i in range(4)]
    assert _sh("git", "show", "HEAD:README", cwd=repo, env=env) == "hello\n"


@pytest.mark.timeout(60)
def test_metadata_chmod_utimens_stat(mnt: Path, client: Client) -> None:
    d = mnt / "t" / "meta"
    d.mkdir(mode=0o750)
    assert stat.S_IMODE(client.stat("/t/meta").mode) == 0o750 & ~_umask()
    p = d / "f"
    p.write_bytes(b"12345")
    os.chmod(p, 0o640)
    assert stat.S_IMODE(client.stat("/t/meta/f").mode) == 0o640
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    os.utime(p, ns=(1_600_000_000_000_000_000, 1_500_000_000_123_456_789))
    assert os.stat(p).st_mtime_ns == 1_500_000_000_123_456_789
    assert client.stat("/t/meta/f").mtime == pytest.approx(1_500_000_000.123456789)
    os.chown(p, 1234, 5678)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    s = client.stat("/t/meta/f")
    assert (s.uid, s.gid, s.size) == (1234, 5678, 5)
    assert stat.S_ISREG(st.st_mode) and stat.S_ISDIR(os.stat(d).st_mode)
    assert st.st_ino == s.inode
    # A change through another client shows once the attribute cache
    # (--attr-timeout, 1 s by default) has expired.
    with client.open("/t/meta/f", "wb") as f:
        f.write(b"longer contents")
    _wait(lambda: os.stat(p).st_size == 15, 10, "the new size through the mount")
    assert p.read_bytes() == b"longer contents"
    # truncate through the mount (setattr size) to shorter and longer.
    os.truncate(p, 3)
    assert client.read_bytes("/t/meta/f") == b"lon"
    os.truncate(p, CHUNK + 1)
    assert p.read_bytes() == b"lon" + bytes(CHUNK - 2)
    # Symlinks; no hard links.
    os.symlink("f", d / "ln")
    assert os.readlink(d / "ln") == "f" and (d / "ln").read_bytes()[:3] == b"lon"
    with pytest.raises(PermissionError):
        os.link(p, d / "hard")
    # Regular files by mknod; no FIFOs or device nodes; no xattrs.
    os.mknod(d / "nod", 0o600 | stat.S_IFREG)
    assert client.stat("/t/meta/nod").is_file
    with pytest.raises(PermissionError):
        os.mkfifo(d / "fifo")
    with pytest.raises(OSError, match="not supported"):
        os.setxattr(p, "user.k", b"v")
    # One writer per file in the cluster: the mount's write waits for none.
    with client.open("/t/meta/busy", "wb") as f:
        f.write(b"sdk")
        fd = os.open(d / "busy", os.O_WRONLY)
        try:
            with pytest.raises(OSError) as err:
                os.write(fd, b"x")
            assert err.value.errno == errno.EBUSY
        finally:
            os.close(fd)
    assert (d / "busy").read_bytes() == b"sdk"
    vfs = os.statvfs(mnt)
    assert vfs.f_blocks > 0 and vfs.f_bavail > 0
    assert vfs.f_files > 0 and vfs.f_ffree == vfs.f_files  # no inode limit: df -i shows 0% used (it said 50%)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def _cli(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    code = cli_run(list(args), stdout=io.StringIO(), stderr=err, env={})
    return code, err.getvalue()


@pytest.mark.timeout(60)
def test_mount_errors_are_clear(mnt: Path, cluster: LocalCluster, tmp_path: Path) -> None:
    meta = ",".join(cluster.meta_addrs)
    # The checks before the daemon forks, in-process (the CLI is a thin shell).
    code, err = _cli("mount", str(tmp_path / "nope"), "--meta", meta)
    assert code == 1 and "does not exist" in err, err
    (tmp_path / "file").write_text("")
    code, err = _cli("mount", str(tmp_path / "file"), "--meta", meta)
    assert code == 1 and "not a directory" in err, err
    code, err = _cli("mount", str(mnt), "--meta", meta)
    assert code == 1 and "already a mount point" in err, err
    code, err = _cli("umount", str(tmp_path))
    assert code == 1 and "not mounted" in err, err
    code, err = _cli("mount", str(tmp_path), "--meta", meta, "--attr-timeout", "-1")
    assert code == 2 and "--attr-timeout" in err and ">= 0" in err, err  # a usage error (rc 1 before stop 43)
    # An unreachable cluster: the daemon's verdict, through the real command.
    (tmp_path / "m").mkdir()
    dead = f"127.0.0.1:{free_ports(1)[0]}"
    t0 = time.monotonic()
    r = run_tierfs("mount", str(tmp_path / "m"), "--meta", dead, "--timeout", "2")
    assert r.returncode == 1 and "unreachable" in r.stderr and "tierfs up" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30
    assert find_mount(str(tmp_path / "m")) is None
    # Over a directory that is not empty: said (its files are hidden while mounted; silent until stop 47).
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept.txt").write_text("x")
    r = run_tierfs("mount", str(tmp_path / "full"), "--meta", dead, "--timeout", "1")
    assert r.returncode == 1 and "is not empty (kept.txt, ...)" in r.stderr, r.stderr
    # A dead mount (its daemon SIGKILLed): said as such, with the way out
    # (it said "does not exist (create it first: mkdir -p ...)").
    dead_mnt = Mount(tmp_path / "dead", cluster.meta_addrs, tmp_path / "dead.log")
    try:
        os.kill(dead_mnt.pid, signal.SIGKILL)
        wait_gone(dead_mnt.pid, 20)
        code, err = _cli("mount", str(dead_mnt.path), "--meta", meta)
        assert code == 1 and "is a dead mount" in err and f"tierfs umount {dead_mnt.path}" in err, err
        code, err = _cli("umount", str(dead_mnt.path))
        assert code == 0, err
        assert find_mount(str(dead_mnt.path)) is None
    finally:
        dead_mnt.close()


def _read_ahead_kb(mp: Path) -> int:
    got = find_mount(str(mp))
    assert got is not None, f"{mp} is not mounted"
    return int(Path(f"/sys/class/bdi/{got[2]}/read_ahead_kb").read_text())


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="setting a mount's read-ahead needs root")
def test_read_ahead_holds_and_sequential_reads_arrive_in_large_requests(
        mnt: Path, cluster: LocalCluster, client: Client, tmp_path: Path) -> None:
    # The kernel applies FUSE_INIT's reply (read-ahead capped at 128 KiB)
    # when the first request is served: a read-ahead set at mount(2) time
    # was silently undone, and every sequential read came as 128 KiB requests.
    assert _read_ahead_kb(mnt) == 4096
    data = random_bytes(4 << 20, 31)
    client.write_bytes("/t/readahead.bin", data)
    m = Mount(tmp_path / "ra", cluster.meta_addrs, tmp_path / "ra.log", "--read-ahead", "2048", "--debug")
    try:
        assert _read_ahead_kb(m.path) == 2048
        with open(m.path / "t" / "readahead.bin", "rb") as f:
            got = b"".join(iter(lambda: f.read(4 << 20), b""))
        assert got == data
        sizes = [int(x) for x in re.findall(r"DEBUG read\(\d+, \d+, (\d+)\)", m.log_text())]
        assert sizes and max(sizes) > 128 * 1024, sizes
    finally:
        m.close()


@pytest.mark.timeout(60)
def test_sigterm_unmounts_foreground_mount(cluster: LocalCluster, client: Client, tmp_path: Path) -> None:
    mp = tmp_path / "fg"
    mp.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = tmp_path / "fg.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tierfs.cli", "mount", str(mp), "--foreground",
                                 "--meta", ",".join(cluster.meta_addrs)], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        _wait(lambda: find_mount(str(mp)) is not None or proc.poll() is not None, 30, "the mount")
        assert proc.poll() is None, log.read_text()
        (mp / "t" / "sigterm.txt").write_bytes(b"before SIGTERM")
        # A file still open for writing when the signal comes: published at unmount.
        fd = os.open(mp / "t" / "open.txt", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"open at SIGTERM")
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        finally:
            with contextlib.suppress(OSError):  # the mount is gone
                os.close(fd)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        subprocess.run(["fusermount3", "-uz", str(mp)], capture_output=True, timeout=30)
    assert proc.returncode == 0, log.read_text()
    assert "signal 15: unmounting" in log.read_text()
    wait_unmounted(mp)
    assert client.read_bytes("/t/sigterm.txt") == b"before SIGTERM"
    assert client.read_bytes("/t/open.txt") == b"open at SIGTERM"


@pytest.mark.timeout(60)
def test_tierfs_umount_unmounts_daemon(cluster: LocalCluster, client: Client, tmp_path: Path) -> None:
    m = Mount(tmp_path / "d", cluster.meta_addrs, tmp_path / "d.log")
    try:
        got = find_mount(str(m.path))
        assert got is not None and got[0] == "fuse.tierfs", got
        (m.path / "t" / "daemon.txt").write_bytes(b"via daemon")
        r = run_tierfs("umount", str(m.path))
        assert r.returncode == 0, r.stderr
        wait_unmounted(m.path)
        wait_gone(m.pid)
        assert client.read_bytes("/t/daemon.txt") == b"via daemon"
        assert "unmounted" in m.log_text()
    finally:
        m.close()


def test_relative_log_path_is_taken_from_the_callers_directory(cluster: LocalCluster, tmp_path: Path) -> None:
    """`tierfs mount m --log mount.log` logs to ./mount.log, as every other
    relative path means. The daemon changes to / before it opens its log,
    so it used to write /mount.log instead (or fail to mount where / is not
    writable)."""
    name = f"tierfs-test-{os.getpid()}-{time.monotonic_ns()}.log"
    (tmp_path / "rel").mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TIERFS_META", None)
    r = subprocess.run([sys.executable, "-m", "tierfs.cli", "mount", "rel", "--meta", ",".join(cluster.meta_addrs),
                        "--log", name], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    try:
        assert r.returncode == 0, r.stderr
        assert "mounted" in (tmp_path / name).read_text()
        assert not Path("/", name).exists()
    finally:
        for log in (tmp_path / name, Path("/", name)):
            m = re.search(r"mounted .* pid (\d+)", log.read_text()) if log.exists() else None
            if m is not None:
                run_tierfs("umount", str(tmp_path / "rel"), timeout=30)
                wait_gone(int(m.group(1)))
        subprocess.run(["fusermount3", "-uz", str(tmp_path / "rel")], capture_output=True, timeout=30)
        Path("/", name).unlink(missing_ok=True)


@pytest.mark.timeout(90)
def test_a_revoked_token_fails_the_mount_clearly_and_keeps_what_was_committed(
        cluster: LocalCluster, client: Client, tmp_path: Path) -> None:
    """A mount whose token is revoked while a file is open: the next close
    fails with EACCES (nothing of the session is published), what an fsync
    made durable before stays and reads back, every later request is EACCES,
    and the mount's log says why (until stop 48 it said nothing: the
    application saw "Permission denied" on its own files with no reason
    anywhere). An expired token takes the same path (UNAUTHENTICATED)."""
    import asyncio

    from tierfs.meta import MetaClient
    from tierfs.security import write_private_file

    async def add_user() -> str:
        async with MetaClient(cluster.meta_addrs, deadline=10) as mc:
            return (await mc.add_user("fuserev", 7601, 7601)).token

    async def revoke() -> None:
        async with MetaClient(cluster.meta_addrs, deadline=10) as mc:
            assert await mc.revoke_token("fuserev", all=True) == 1

    token = asyncio.run(add_user())
    client.mkdir("/rev", exist_ok=True)
    client.chown("/rev", 7601, 7601)
    tok = write_private_file(tmp_path / "user.token", token + "\n")
    m = Mount(tmp_path / "m", cluster.meta_addrs, tmp_path / "m.log", "--token-file", str(tok))
    try:
        f = m.path / "rev" / "f"
        fd = os.open(f, os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd, b"durable")
            os.fsync(fd)
            os.write(fd, b" and lost")
            asyncio.run(revoke())
            with pytest.raises(PermissionError):
                os.close(fd)
            fd = -1
        finally:
            if fd >= 0:
                os.close(fd)
        with pytest.raises(PermissionError):
            os.listdir(m.path / "rev")
        assert client.read_bytes("/rev/f") == b"durable"
        log = m.log_text()
        assert "meta refuses this mount's credential: token 1 of user 'fuserev' was revoked" in log, log
        assert "flush: the commit failed" in log and "EACCES" in log, log
    finally:
        m.close()
