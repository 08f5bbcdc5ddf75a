"""LocalCluster.grow (what `tierfs up --storage N` does on an existing
cluster) plans new storage daemons without touching the planned ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierfs.errors import ConfigError
from tierfs.local import LocalCluster


def test_grow_adds_storage_daemons_and_keeps_the_plan(tmp_path: Path) -> None:
    cl = LocalCluster(tmp_path / "c", n_meta=1, n_storage=2, targets_per_node=2, racks=["a", "b"])
    cl.dir.mkdir(parents=True)
    cl._save_state()
    before = {p.name: (p.addr, list(p.argv)) for p in cl.procs}
    again = LocalCluster.open(tmp_path / "c")
    assert again.grow(4, racks=["c"]) == ["storage-2", "storage-3"]
    reopened = LocalCluster.open(tmp_path / "c")
    assert reopened.counts == {"meta": 1, "storage": 4, "targets_per_node": 2}
    after = {p.name: (p.addr, list(p.argv)) for p in reopened.procs}
    assert all(after[n] == v for n, v in before.items())  # the planned ones are untouched
    assert len({a for a, _ in after.values()}) == len(after)  # fresh ports
    assert "--rack=c" in after["storage-2"][1] and not any(a.startswith("--rack") for a in after["storage-3"][1])
    assert "--rack=a" in after["storage-0"][1]
    assert reopened.grow(4) == []
    with pytest.raises(ConfigError, match="drain"):
        reopened.grow(3)


def test_up_with_fewer_storage_than_planned_is_refused(tmp_path: Path) -> None:
    """`tierfs up --storage 1` on a plan of 2 storage daemons is refused
    (it said "reused as planned ... nothing to do" and exited 0), and starts
    nothing."""
    import io

    from tierfs.cli import run

    cl = LocalCluster(tmp_path / "c", n_meta=1, n_storage=2)
    cl.dir.mkdir(parents=True)
    cl._save_state()
    err = io.StringIO()
    rc = run(["up", "--data", str(cl.dir), "--storage", "1"], stdout=io.StringIO(), stderr=err, env={})
    assert rc == 1 and "would remove some" in err.getvalue() and "drain" in err.getvalue(), (rc, err.getvalue())
    assert not any(LocalCluster.open(cl.dir).running().values())


def test_grow_does_not_reuse_the_directory_of_a_removed_node(tmp_path: Path) -> None:
    """`tierfs node rm` drops the node's daemon from the plan and keeps its
    directory (its node.uuid and fragment files). A later `tierfs up
    --storage N` gave the next daemon the removed one's name when it had the
    highest index, so the "new" node started in that directory: with the
    removed node's identity and its old fragments (orphans on a node that
    should be empty)."""
    cl = LocalCluster(tmp_path / "c", n_meta=1, n_storage=3)
    cl.dir.mkdir(parents=True)
    (cl.dir / "storage-2").mkdir()
    (cl.dir / "storage-2" / "node.uuid").write_text("9ca99f9c-d799-43e4-b4b2-7fc607464182\n")
    cl.procs = [p for p in cl.procs if p.name != "storage-2"]  # what `tierfs node rm` leaves
    cl._save_state()
    again = LocalCluster.open(cl.dir)
    assert again.grow(4) == ["storage-3", "storage-4"]
    dirs = {a for p in LocalCluster.open(cl.dir).procs for a in p.argv if a.startswith("--data-dir=")}
    assert f"--data-dir={cl.dir / 'storage-2'}" not in dirs
