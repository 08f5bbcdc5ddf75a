"""makedirs_durable: every level it creates survives a power cut (LazyFS)."""

from pathlib import Path

import pytest

from tests.faults import LazyFS
from tierfs.fsutil import makedirs_durable

pytestmark = pytest.mark.skipif(not LazyFS.available(), reason="needs /dev/fuse and fusermount3")


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
