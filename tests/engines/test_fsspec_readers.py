"""``tierfs://`` under the libraries that reach storage through fsspec, on the
engines' session cluster: pandas (to_parquet / read_parquet), pyarrow
(``PyFileSystem(FSSpecHandler(fs))``, a partitioned parquet dataset),
``torch.save`` / ``torch.load`` through ``fsspec.open``, and PyTorch
Distributed Checkpoint by URL (``dcp.save(..., checkpoint_id="tierfs://...")``)
and through ``FsspecWriter`` / ``FsspecReader`` explicitly: tensors come back
bit-identical."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from tierfs.client import Client
from tierfs.integrations.fsspec import TierFSFileSystem

pytestmark = pytest.mark.timeout(60)

ROOT = "/fsspec-readers"
URL3 = "tierfs://" + ROOT  # tierfs:///fsspec-readers
URL2 = "tierfs:/" + ROOT  # tierfs://fsspec-readers: the same directory
NO_PG = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def fs(tierfs_meta: str) -> Iterator[TierFSFileSystem]:
    with Client(tierfs_meta) as c:
        c.mkdir(ROOT, exist_ok=True)
        c.set_layout(ROOT, redundancy="ec:2+1", chunk_size=256 << 10)  # several chunks per file
    f = TierFSFileSystem(meta=tierfs_meta, skip_instance_cache=True)
    yield f
    f.close()


def frame(n: int = 5000) -> pd.DataFrame:
    return pd.DataFrame({
        "i": range(n),
        "x": [i * 0.5 for i in range(n)],
        "s": [f"row-{i}" for i in range(n)],
        "part": [i % 3 for i in range(n)],
    })


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(
        torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def state_dict() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(300, 257, generator=g),  # ~300 KiB: more than one chunk
        "b16": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "nan": torch.tensor([float("nan"), -0.0, float("inf"), 1.0]),
        "ids": torch.arange(1000, dtype=torch.int64),
        "mask": torch.rand(17, generator=g) > 0.5,
        "step": torch.tensor(1200),
        "nested": {"m": torch.randn(7, 7, generator=g, dtype=torch.float64)},
    }


def zeros_like_tree(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: zeros_like_tree(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in sd.items()}


def assert_tree_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, dict):
            assert_tree_equal(got[k], v)
        else:
            assert same_bits(got[k], v), k


def test_pandas_parquet(fs: TierFSFileSystem, tierfs_env: str) -> None:
    df = frame()
    df.to_parquet(f"{URL2}/pandas/df.parquet")  # the cluster from TIERFS_META
    back = pd.read_parquet(f"{URL2}/pandas/df.parquet")
    pd.testing.assert_frame_equal(back, df)
    opts = {"meta": tierfs_env}
    df.to_csv(f"{URL3}/pandas/df.csv", index=False, storage_options=opts)
    pd.testing.assert_frame_equal(pd.read_csv(f"{URL3}/pandas/df.csv", storage_options=opts), df)
    assert fs.info(f"{ROOT}/pandas/df.parquet")["size"] > 0


def test_pyarrow_dataset(fs: TierFSFileSystem) -> None:
    handler = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    table = pa.Table.from_pandas(frame(), preserve_index=False)
    pq.write_to_dataset(table, f"{ROOT}/arrow/ds", filesystem=handler, partition_cols=["part"])
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{ROOT}/arrow/ds", detail=False)) == \
        ["part=0", "part=1", "part=2"]
    back = pads.dataset(f"{ROOT}/arrow/ds", filesystem=handler, format="parquet",
                        partitioning="hive").to_table().to_pandas()
    back = back.sort_values("i").reset_index(drop=True)
    want = frame()
    assert back["i"].tolist() == want["i"].tolist() and back["s"].tolist() == want["s"].tolist()
    assert [int(p) for p in back["part"]] == want["part"].tolist()
    # One file, read back with random access (parquet reads its footer first).
    pq.write_table(table, f"{ROOT}/arrow/one.parquet", filesystem=handler, row_group_size=1000)
    pf = pq.ParquetFile(handler.open_input_file(f"{ROOT}/arrow/one.parquet"))
    assert pf.metadata.num_row_groups == 5
    assert pf.read_row_group(3).column("i").to_pylist() == list(range(3000, 4000))
    info = handler.get_file_info(f"{ROOT}/arrow/one.parquet")
    assert info.type == pafs.FileType.File and info.size == fs.size(f"{ROOT}/arrow/one.parquet")


def test_torch_save_load(fs: TierFSFileSystem, tierfs_meta: str) -> None:
    sd = state_dict()
    url = f"{URL3}/torch/model.pt"
    with fsspec.open(url, "wb", meta=tierfs_meta) as f:
        torch.save(sd, f)
    with fsspec.open(url, "rb", meta=tierfs_meta) as f:
        back = torch.load(f, weights_only=True)
    assert_tree_equal(back, sd)
    with fs.open(f"{ROOT}/torch/model.pt", "rb") as f:  # mmap-less lazy load also seeks around
        assert same_bits(torch.load(f, weights_only=True, map_location="cpu")["w"], sd["w"])


@NO_PG
def test_dcp_by_url(fs: TierFSFileSystem, tierfs_env: str) -> None:
    """No process group: DCP picks FsspecWriter / FsspecReader for the URL
    (the cluster comes from TIERFS_META: a checkpoint_id carries no options)."""
    sd = state_dict()
    url = f"{URL3}/ckpt/by-url"
    dcp.save(sd, checkpoint_id=url)
    assert fs.exists(f"{ROOT}/ckpt/by-url/.metadata")
    back = zeros_like_tree(sd)
    dcp.load(back, checkpoint_id=url)
    assert_tree_equal(back, sd)


@NO_PG
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning")  # the overwrite below
def test_dcp_fsspec_writer_reader(fs: TierFSFileSystem, tierfs_meta: str) -> None:
    sd = state_dict()
    url = f"{URL2}/ckpt/explicit"
    # sync_files=False: a TierFS file is durable once closed; DCP's sync for a
    # stream without a file descriptor would be os.sync() of the whole host.
    writer = FsspecWriter(url, thread_count=2, sync_files=False, meta=tierfs_meta)
    dcp.save(sd, storage_writer=writer)
    names = fs.ls(f"{ROOT}/ckpt/explicit", detail=False)
    assert f"{ROOT}/ckpt/explicit/.metadata" in names and len(names) >= 2  # metadata + data files
    back = zeros_like_tree(sd)
    dcp.load(back, storage_reader=FsspecReader(url, meta=tierfs_meta))
    assert_tree_equal(back, sd)
    # Saved again over the same id (overwrite): the new values come back.
    sd2 = {k: (v + 1 if isinstance(v, torch.Tensor) and v.dtype.is_floating_point else v) for k, v in sd.items()}
    dcp.save(sd2, storage_writer=FsspecWriter(url, sync_files=False, overwrite=True, meta=tierfs_meta))
    back2 = zeros_like_tree(sd2)
    dcp.load(back2, storage_reader=FsspecReader(url, meta=tierfs_meta))
    assert_tree_equal(back2, sd2)
