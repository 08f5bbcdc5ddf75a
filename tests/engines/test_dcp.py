"""PyTorch Distributed Checkpoint through tierfs.integrations.torch_dcp, on
the engines' session cluster: ranks are subprocesses (tests/engines/dcp_worker.py)
in a gloo group on loopback, each with its own TierFS Client."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.engines.conftest import REPO
from tierfs.client import Client
from tierfs.errors import ConfigError, InvalidArgumentError, NotFoundError
from tierfs.integrations.torch_dcp import TierFSStorageReader, TierFSStorageWriter, tierfs_path
from tierfs.local import LocalCluster, free_ports

WORLD = 4


@dataclass
class Run:
    outs: list[str]
    workdir: Path

    def text(self, rank: int) -> str:
        return f"rank {rank}:\n{self.outs[rank][-4000:]}"


def launch(world: int, root: str, workdir: Path, meta: str, timeout: float) -> list[str]:
    """Run ``world`` ranks of tests/engines/dcp_worker.py; every one is
    killed by the end. Returns each rank's output."""
    port = free_ports(1)[0]
    env = {**os.environ, "TIERFS_META": meta, "DCP_ROOT": root, "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1", "DCP_T0": str(time.time())}
    # Output to files, not pipes: a rank blocked on a full pipe would look hung.
    logs = [workdir / f"rank{r}.log" for r in range(world)]
    procs: list[subprocess.Popen[bytes]] = []
    outs: list[str] = []
    try:
        for r in range(world):
            with logs[r].open("w") as out:
                procs.append(subprocess.Popen([sys.executable, "-m", "tests.engines.dcp_worker", str(r), str(world),
                                               str(port), str(workdir)], cwd=REPO, env=env, stdout=out,
                                              stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout
        for r, p in enumerate(procs):
            note = ""
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                note = "\n[killed by the test: timed out]"
            outs.append(logs[r].read_text() + note)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"--- rank 0:\n{outs[0] if outs else ''}")
    return outs


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def root(tierfs_meta: str) -> str:
    """A directory of its own; small chunks, so that files and tensors
    span several chunks and storage nodes."""
    path = f"/dcp-{uuid.uuid4().hex[:8]}"
    with Client(tierfs_meta) as c:
        c.mkdir(path)
        c.set_layout(path, chunk_size=64 << 10, redundancy="ec:2+1")
    return path


@pytest.fixture(scope="module")
def run(tierfs_meta: str, root: str, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One launch of 4 ranks for the three distributed tests (starting
    torch in 4 processes is most of their time): save and interop, then
    ranks 0-1 load resharded, then a save that loses rank 2."""
    workdir = tmp_path_factory.mktemp("dcp")
    return Run(launch(WORLD, root, workdir, tierfs_meta, timeout=170), workdir)


@pytest.mark.timeout(200)  # the launch (the module fixture) runs inside this test's timeout
def test_save_4_ranks_load_back_and_through_filesystem_reader(run: Run, tierfs_meta: str, root: str) -> None:
    """4 ranks save a sharded transformer + Adam state (twice to one path),
    and the same state dict with FileSystemWriter (torch_save and
    safetensors formats) to local disk; it loads bit-identical through
    either reader: TierFS, TierFS copied to disk, local uploaded to TierFS."""
    for r in range(WORLD):
        assert "OK save" in run.outs[r], run.text(r)
    with Client(tierfs_meta) as c:
        names = c.ls(f"{root}/ckpt")
    # The first save's files went once the second committed.
    tags = {n.split("_")[3] for n in names if n.endswith(".distcp")}
    assert len(tags) == 1 and ".metadata" in names, names
    assert not [n for n in names if n.endswith(".tmp")], names


@pytest.mark.timeout(200)  # as above, when run alone
def test_save_with_4_ranks_loads_with_2(run: Run) -> None:
    for r in range(2):
        assert "OK reshard" in run.outs[r], run.text(r)


@pytest.mark.timeout(200)  # as above, when run alone
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_rank_killed_mid_save_leaves_previous_checkpoint(run: Run, tierfs_meta: str, root: str) -> None:
    assert "rank 2 dies mid-save" in run.outs[2], run.text(2)
    for r in (0, 1, 3):
        assert "OK crash" in run.outs[r], run.text(r)
    expected = torch.load(run.workdir / "expected.pt", weights_only=True)
    with Client(tierfs_meta) as c:
        # A single process loads the full tensors of the committed checkpoint: v1.
        want = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
        # Every other small matrix and big_f32 land in transposed
        # (non-contiguous) tensors: copies; big_bf16 is read in place.
        got = {k: torch.empty(v.shape[::-1], dtype=v.dtype).t() if v.dim() == 2 and (
            "big_f32" in k or (i % 2 and "big" not in k))
               else torch.empty_like(v) for i, (k, v) in enumerate(want.items())}
        reader = TierFSStorageReader(f"{root}/crash", client=c)
        dcp.load(got, storage_reader=reader, no_dist=True)
        for k, v in want.items():
            assert bits_equal(got[k].contiguous(), v), k
        assert reader.stats.direct and reader.stats.copied and reader.stats.small, reader.stats
        # The dead save left data files of its own, unreferenced (the next
        # committed save removes them).
        names = c.ls(f"{root}/crash")
        assert len({n.split("_")[3] for n in names if n.endswith(".distcp")}) == 2, names


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_incomplete_and_missing_checkpoints_are_clear_errors(tierfs_meta: str, root: str) -> None:
    with Client(tierfs_meta) as c:
        c.mkdir(f"{root}/partial", parents=True, exist_ok=True)
        c.write_bytes(f"{root}/partial/__0_abc_0.distcp", b"x" * 100)
        with pytest.raises(NotFoundError, match=r"incomplete.*no committed \.metadata"):
            TierFSStorageReader(f"{root}/partial", client=c).read_metadata()
        with pytest.raises(NotFoundError, match="does not exist"):
            TierFSStorageReader(f"{root}/nonexistent", client=c).read_metadata()
        with pytest.raises(CheckpointException, match="does not exist"):
            dcp.load({"x": torch.zeros(2)}, storage_reader=TierFSStorageReader(f"{root}/nonexistent", client=c),
                     no_dist=True)
        # A .metadata that is no pickle names the file (DCP's "metadata is None" until stop 47)
        from tierfs.errors import CorruptError

        for junk in (b"", b"garbage"):
            c.write_bytes(f"{root}/partial/.metadata", junk)
            with pytest.raises(CorruptError, match=rf"{root}/partial/\.metadata: not a checkpoint's metadata"):
                TierFSStorageReader(f"{root}/partial", client=c).read_metadata()


@pytest.mark.timeout(30)
def test_missing_meta_config_names_tierfs_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERFS_META", raising=False)
    with pytest.raises(ConfigError, match="TIERFS_META"):
        TierFSStorageWriter("/x")
    with pytest.raises(ConfigError, match="TIERFS_META"):
        TierFSStorageReader("/x")
    assert tierfs_path("tierfs:///a//b/") == tierfs_path("tierfs://a/b") == "/a/b"
    assert not TierFSStorageWriter.validate_checkpoint_id("s3://bucket/x")
    assert not TierFSStorageWriter.validate_checkpoint_id("relative/dir")
    assert TierFSStorageReader.validate_checkpoint_id("tierfs:///ckpt/step-1")


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_single_process_views_overwrite_and_rank_local_metadata(tierfs_meta: str, root: str) -> None:
    """Without a process group: a view into a larger storage and a
    non-contiguous tensor are packed (counted) and load back equal;
    overwrite=False and use_collectives=False are refused clearly."""
    base = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    sd = {"rows": base[:8], "cols": base[:, ::2], "whole": torch.randn(128, 256), "n": 3}
    with Client(tierfs_meta) as c:
        w = TierFSStorageWriter(f"{root}/single", client=c)
        dcp.save(sd, storage_writer=w, no_dist=True)
        assert w.copied_tensors == 2
        got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
        dcp.load(got, storage_reader=TierFSStorageReader(f"{root}/single", client=c), no_dist=True)
        for k, v in sd.items():
            assert bits_equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
        with pytest.raises(CheckpointException, match="already exists"):
            dcp.save(sd, storage_writer=TierFSStorageWriter(f"{root}/single", client=c, overwrite=False),
                     no_dist=True)
        with pytest.raises(InvalidArgumentError, match="use_collectives=True"):
            dcp.save(sd, storage_writer=TierFSStorageWriter(f"{root}/single2", client=c), no_dist=True,
                     use_collectives=False)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_load_through_a_latest_link(tierfs_meta: str, root: str) -> None:
    """The usual "latest" link to the newest checkpoint directory: DCP
    loads through it (the reader said "/ckpt/latest is not a directory")."""
    sd = {"w": torch.randn(64, 32), "step": 7}
    with Client(tierfs_meta) as c:
        dcp.save(sd, storage_writer=TierFSStorageWriter(f"{root}/step-7", client=c), no_dist=True)
        c.symlink(f"{root}/latest", "step-7")
        got = {"w": torch.zeros(64, 32), "step": 0}
        dcp.load(got, storage_reader=TierFSStorageReader(f"{root}/latest", client=c), no_dist=True)
        assert bits_equal(got["w"], sd["w"]) and got["step"] == 7


@pytest.mark.timeout(30)
def test_region_is_one_run_exactly_when_the_box_is_contiguous() -> None:
    """The reader reads a box of a stored tensor in place only when its
    elements are one run; checked against torch on every box of a 3-d tensor."""
    import itertools

    from tierfs.integrations.torch_dcp import _region, _Stored

    size = (4, 3, 5)
    full = torch.arange(60).reshape(size)
    st = _Stored(0, 60, torch.int64, size, (15, 5, 1), 0)
    spans = [[(o, n) for o in range(s) for n in range(1, s - o + 1)] for s in size]
    for box in itertools.product(*spans):
        offsets, lengths = [o for o, _ in box], [n for _, n in box]
        view = full
        for d, (o, n) in enumerate(box):
            view = view.narrow(d, o, n)
        run = _region(st, offsets, lengths)
        if view.is_contiguous():
            assert run is not None, box
            first, count = run
            assert torch.equal(view.reshape(-1), torch.arange(first, first + count)), box
        else:
            assert run is None, box
    assert _region(_Stored(0, 60, torch.int64, (5, 12), (1, 5), 0), [0, 0], [5, 12]) is None  # transposed


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_storage_failure_mid_save_is_the_error_dcp_reports(tmp_path: Path) -> None:
    """A storage node SIGKILLed while a save writes its tensors (ec:2+1 on
    three nodes: a chunk needs all three): the save fails with TierFS's
    error, naming the file and the chunk. Until stop 47 torch.save's zip
    writer went on to write its end records after the failed write and
    raised "unexpected pos ...", the only error DCP showed."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from tests.faults.harness import FAST_META

    cl = LocalCluster(tmp_path / "c", n_storage=3, extra_meta_args=list(FAST_META))
    cl.up(timeout=120)
    try:
        victim = next(p.name for p in cl.procs if p.kind == "storage")

        class KillAtSecondTensor(DefaultSavePlanner):
            seen = 0

            def resolve_data(self, write_item: Any) -> Any:
                if write_item.type.name != "BYTE_IO":
                    KillAtSecondTensor.seen += 1
                    if KillAtSecondTensor.seen == 2:
                        cl.kill(victim)
                return super().resolve_data(write_item)

        sd = {f"t{i}": torch.randn(256, 1024) for i in range(4)}  # 1 MiB each: 16 chunks
        with Client(cl.meta_addrs, request_timeout=2.0, retries=2) as c:
            c.mkdir("/ck")
            c.set_layout("/ck", chunk_size=64 << 10, redundancy="ec:2+1")
            with pytest.raises(CheckpointException) as ei:
                dcp.save(sd, storage_writer=TierFSStorageWriter("/ck/a", client=c, thread_count=1),
                         planner=KillAtSecondTensor(), no_dist=True)
        text = str(ei.value)
        assert KillAtSecondTensor.seen >= 2
        assert "unexpected pos" not in text, text
        assert "could not be stored" in text and ".distcp" in text, text
    finally:
        cl.stop()


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_when_one_file_of_a_save_fails_the_others_stop(tmp_path: Path) -> None:
    """thread_count files at once; one fails at its third tensor: the other
    threads stop at their next tensor (until stop 48 they wrote every tensor
    of their files, for a save already lost), and DCP reports the failure,
    not the others' stopping. Nothing of the save is left."""
    import threading

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    cl = LocalCluster(tmp_path / "c", n_meta=1, n_storage=1)
    cl.up(timeout=120)
    try:
        state = {"resolved": 0, "failed_at": None}
        guard = threading.Lock()

        class FailOnce(DefaultSavePlanner):
            def resolve_data(self, write_item: Any) -> Any:
                with guard:
                    state["resolved"] += 1
                    if state["resolved"] == 3:
                        state["failed_at"] = 3
                        raise RuntimeError("the disk under tensor 3 is on fire")
                return super().resolve_data(write_item)

        sd = {f"t{i:02d}": torch.randn(64, 64) for i in range(40)}
        with Client(cl.meta_addrs) as c:
            c.mkdir("/ck")
            c.set_layout("/ck", redundancy="replica:1")
            with pytest.raises(CheckpointException) as ei:
                dcp.save(sd, storage_writer=TierFSStorageWriter("/ck/a", client=c, thread_count=4),
                         planner=FailOnce(), no_dist=True)
            assert "on fire" in str(ei.value) and "another file" not in str(ei.value), str(ei.value)
            # Each of the 3 others may finish the tensor it had begun (and one
            # take the lock the failing one had just released): 40 before.
            assert state["resolved"] - 3 <= 6, state
            assert not [n for n in c.ls("/ck/a") if n.endswith(".distcp")], c.ls("/ck/a")
    finally:
        cl.stop()


ASYNC_PROCESS_SAVE = r"""
import datetime, os, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from tierfs.integrations.torch_dcp import TierFSStorageReader, TierFSStorageWriter

def main():
    path, port = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(3)
    want = {"w": torch.randn(256, 512, generator=g), "h": torch.randn(64, 64, generator=g).half(), "step": 5}
    sd = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in want.items()}
    with TierFSStorageWriter(path) as w:
        for step in (5, 6):  # the checkpoint process is reused by the second save
            want["step"] = sd["step"] = step
            fut = dcp.async_save(sd, storage_writer=w, async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            sd["w"].fill_(0)  # training goes on: the save has its own copy
            fut.result()
            sd["w"].copy_(want["w"])
    got = {"w": torch.zeros(256, 512), "h": torch.zeros(64, 64).half(), "step": 0}
    with TierFSStorageReader(path) as r:
        dcp.load(got, storage_reader=r)
    for k in ("w", "h"):
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert got["step"] == 6, got["step"]
    print("OK async process save", flush=True)
    dist.destroy_process_group()
    os._exit(0)  # the checkpoint process is torch's; do not wait on its teardown

if __name__ == "__main__":
    main()
"""


@pytest.mark.timeout(180)
def test_async_save_in_a_checkpoint_process(tierfs_meta: str, root: str, tmp_path: Path) -> None:
    """dcp.async_save with AsyncCheckpointerType.PROCESS pickles the writer
    into torch's checkpoint process (torchtitan's async_with_pinned_mem
    does this): two saves, then a load, bit-identical. Until stop 47 the
    writer held its client and the save failed with "cannot pickle
    '_thread.lock' object"."""
    script = tmp_path / "async_process_save.py"
    script.write_text(ASYNC_PROCESS_SAVE)
    env = {**os.environ, "TIERFS_META": tierfs_meta, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "out.log"
    with log.open("w") as out:
        p = subprocess.Popen([sys.executable, str(script), f"{root}/async-process", str(free_ports(1)[0])],
                             cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            p.wait(timeout=150)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    text = log.read_text()
    assert p.returncode == 0 and "OK async process save" in text, text[-4000:]


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_writer_and_reader_pickle_with_a_client_of_their_own(tierfs_meta: str, root: str) -> None:
    """A pickled writer or reader connects with its client's arguments; the
    copy works after the original is closed, and copies share one client."""
    import pickle

    sd = {"w": torch.randn(64, 32), "step": 9}
    with TierFSStorageWriter(f"{root}/pickled", meta=tierfs_meta) as w:
        blob = pickle.dumps(w)
    w2, w3 = pickle.loads(blob), pickle.loads(blob)
    assert w2.client is w3.client and not w2.client._closed
    dcp.save(sd, storage_writer=w2, no_dist=True)
    with Client(tierfs_meta) as c:
        r = TierFSStorageReader(f"{root}/pickled", client=c)
        got = {"w": torch.zeros(64, 32), "step": 0}
        dcp.load(got, storage_reader=pickle.loads(pickle.dumps(r)), no_dist=True)
        assert c._closed is False  # the copy never closes the caller's client
    assert bits_equal(got["w"], sd["w"]) and got["step"] == 9
