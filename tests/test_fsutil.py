"""makedirs_durable: every level it creates survives a power cut (LazyFS);
write_durable: a file replaced whole, durably, by any number of writers."""

import threading
from pathlib import Path

import pytest

from tests.faults import LazyFS
from tierfs.fsutil import makedirs_durable, write_durable

needs_fuse = pytest.mark.skipif(not LazyFS.available(), reason="needs /dev/fuse and fusermount3")


@needs_fuse
@pytest.mark.timeout(60)
def test_nested_new_directories_survive_power_loss(lazy: LazyFS, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    makedirs_durable(mnt / "a" / "b" / "c")
    makedirs_durable(mnt / "a" / "b" / "c")  # idempotent
    (mnt / "plain" / "x").mkdir(parents=True)  # what makedirs_durable replaces
    lazy.power_loss()
    lazy.mount()
    assert (mnt / "a" / "b" / "c").is_dir()
    assert not (mnt / "plain").exists()  # proves the simulator would catch the bug


@pytest.mark.timeout(30)
def test_refuses_a_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(OSError):
        makedirs_durable(tmp_path / "f" / "sub")


@needs_fuse
@pytest.mark.timeout(60)
def test_a_file_written_durably_survives_a_power_cut(lazy: LazyFS, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    write_durable(mnt / "plan", b"one")
    write_durable(mnt / "plan", b"two")
    (mnt / "plain").write_bytes(b"x")  # what write_durable replaces
    lazy.power_loss()
    lazy.mount()
    assert (mnt / "plan").read_bytes() == b"two"
    assert not (mnt / "plain").exists()
    assert sorted(p.name for p in mnt.iterdir()) == ["plan"]


@pytest.mark.timeout(60)
def test_writers_of_one_file_do_not_rename_each_others_temporary(tmp_path: Path) -> None:
    """Threads saving one local cluster's plan at once (a nemesis restarting
    a daemon while the walk starts another) once failed with
    FileNotFoundError: both wrote and renamed the same temporary file."""
    path = tmp_path / "cluster.toml"
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            for j in range(50):
                write_durable(path, b"%d-%d" % (i, j))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert path.read_bytes().endswith(b"-49")
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.toml"]
