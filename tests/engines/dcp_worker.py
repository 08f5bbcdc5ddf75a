"""One rank of the DCP tests (tests/engines/test_dcp.py), run as
``python -m tests.engines.dcp_worker RANK WORLD PORT WORKDIR`` with
TIERFS_META and DCP_ROOT (the TierFS directory) set. Ranks form a gloo group
on loopback; each uses its own TierFS Client. A tiny transformer's
parameters are sharded with DTensor (Shard(0)) on a CPU mesh, one Adam step
makes optimizer state, and the state dict (model, optimizer, extra bf16 /
float32 / int64 tensors, non-tensor values) goes through
torch.distributed.checkpoint. One launch runs three phases, each printing
``OK <phase>`` (starting torch in 4 processes is most of the time):

* ``save``: save to TierFS twice to the same path (the second replaces the
  first), and to local disk with FileSystemWriter (TORCH_SAVE and
  SAFETENSORS formats); rank 0 writes the full tensors as ``expected.pt``.
  Loads back, bit-identical: TierFS -> TierFSStorageReader (a fresh model
  and optimizer, set_state_dict); the TierFS checkpoint downloaded ->
  FileSystemReader; each local checkpoint uploaded into TierFS ->
  TierFSStorageReader.
* ``reshard``: ranks 0 and 1 load the 4-rank checkpoint on a 2-rank mesh and
  compare the full tensors with ``expected.pt``.
* ``crash``: the first phase's state dict is committed at crash/, then a
  save of another one there loses rank 2, which SIGKILLs itself inside
  write_data after 16 KiB; the survivors report the broken group and exit.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

from tierfs.client import Client
from tierfs.integrations.torch_dcp import TierFSStorageReader, TierFSStorageWriter

D_MODEL, FF, LAYERS = 64, 256, 2


def build(mesh: Any, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(D_MODEL, nhead=4, dim_feedforward=FF, batch_first=True)
    model = nn.Sequential(nn.Embedding(100, D_MODEL), nn.TransformerEncoder(layer, LAYERS,
                                                                             enable_nested_tensor=False))
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    # One step with deterministic gradients gives the optimizer state.
    for p in model.parameters():
        p.grad = p.detach() * 0.5 + 0.01 * seed
    opt.step()
    opt.zero_grad()
    return model, opt


def state(model: nn.Module, opt: torch.optim.Optimizer, mesh: Any, seed: int) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    g = torch.Generator().manual_seed(seed)
    return {
        "model": msd, "optim": osd,
        "extra": {
            "bf16": distribute_tensor(torch.randn(96, 40, generator=g).to(torch.bfloat16), mesh, [Shard(0)]),
            # Shards over 64 KiB: read straight into their destination.
            "big_bf16": distribute_tensor(torch.randn(640, 256, generator=g).to(torch.bfloat16), mesh, [Shard(0)]),
            "big_f32": distribute_tensor(torch.randn(640, 128, generator=g), mesh, [Shard(0)]),
            "ids": distribute_tensor(torch.randint(0, 1 << 40, (64, 8), generator=g), mesh, [Shard(0)]),
            "step": 100 + seed, "name": f"run-{seed}",
        },
    }


def flat(sd: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(sd, dict):
        for k, v in sd.items():
            out.update(flat(v, f"{prefix}{k}."))
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            out.update(flat(v, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".")] = sd
    return out


def full(v: Any) -> Any:
    return v.full_tensor() if isinstance(v, DTensor) else v


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
                                b.contiguous().view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8)))
    return bool(a == b)


def check(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    g, w = flat(got), flat(want)
    assert g.keys() == w.keys(), (what, sorted(set(g) ^ set(w)))
    for k in w:
        a, b = g[k], w[k]
        if isinstance(b, DTensor):
            assert isinstance(a, DTensor), (what, k)
            a, b = a.to_local(), b.to_local()
        assert same(a, b), f"{what}: {k} differs"


def fresh_state(mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model, opt = build(mesh, seed=99)
    return model, opt, state(model, opt, mesh, seed=99)


def load_into(mesh: Any, reader: Any) -> dict[str, Any]:
    model, opt, sd = fresh_state(mesh)
    dcp.load(sd, storage_reader=reader)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return sd


def download(c: Client, src: str, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in c.ls(src):
        (dst / name).write_bytes(c.read_bytes(f"{src}/{name}"))


def upload(c: Client, src: Path, dst: str) -> None:
    c.mkdir(dst, parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        c.write_bytes(f"{dst}/{p.name}", p.read_bytes())


def log(msg: str) -> None:
    """Progress with seconds since the launch (the test prints rank 0's)."""
    print(f"[{time.time() - float(os.environ.get('DCP_T0', '0')):6.1f}s] {msg}", flush=True)


def blank(sd: Any) -> Any:
    """A destination like ``sd``: tensors zeroed (DTensors with the same
    sharding), the non-tensor values of ``extra`` changed, so a load must
    write every one of them."""
    out = _zeroed(sd)
    out["extra"].update(step=-1, name="")
    return out


def _zeroed(sd: Any) -> Any:
    if isinstance(sd, dict):
        return {k: _zeroed(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_zeroed(v) for v in sd]
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    return sd


def phase_save_and_interop(c: Client, mesh: Any, rank: int, root: str, workdir: Path) -> dict[str, Any]:
    model, opt = build(mesh, seed=1)
    sd1 = state(model, opt, mesh, seed=1)
    log("built")
    dcp.save(sd1, storage_writer=TierFSStorageWriter(f"{root}/ckpt", client=c))
    log("saved")
    model2, opt2 = build(mesh, seed=2)
    sd = state(model2, opt2, mesh, seed=2)
    # The second save to the same path replaces the first.
    w = TierFSStorageWriter("tierfs:///unused", client=c, thread_count=3)
    dcp.save(sd, storage_writer=w, checkpoint_id=f"tierfs://{root.lstrip('/')}/ckpt")
    log("two saves to TierFS")
    local, local_st = workdir / "local", workdir / "local_st"
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(local)))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(
        str(local_st), serialization_format=dcp.filesystem.SerializationFormat.SAFETENSORS))
    expected = {k: full(v) for k, v in flat(sd).items()}
    if rank == 0:
        torch.save(expected, workdir / "expected.pt")
        download(c, f"{root}/ckpt", workdir / "downloaded")
        upload(c, local, f"{root}/from_local")
        upload(c, local_st, f"{root}/from_local_st")
    dist.barrier()
    log("local saves, copies")
    # The whole path once: a fresh model and optimizer, set_state_dict.
    reader = TierFSStorageReader(f"{root}/ckpt", client=c)
    check(load_into(mesh, reader), sd, "tierfs -> TierFSStorageReader")
    assert reader.stats.direct > 0, reader.stats
    log(f"rank {rank} loaded, read stats {reader.stats}")
    for what, rd in [("tierfs copied to disk -> FileSystemReader", dcp.FileSystemReader(str(workdir / "downloaded"))),
                     ("FileSystemWriter -> FileSystemReader", dcp.FileSystemReader(str(local))),
                     ("FileSystemWriter uploaded -> TierFSStorageReader",
                      TierFSStorageReader(f"{root}/from_local", client=c)),
                     ("FileSystemWriter safetensors uploaded -> TierFSStorageReader",
                      TierFSStorageReader(f"{root}/from_local_st", client=c))]:
        dest = blank(sd)
        dcp.load(dest, storage_reader=rd)
        check(dest, sd, what)
        log(what)
        if isinstance(rd, TierFSStorageReader):
            assert rd.stats.direct > 0, (what, rd.stats)
    return sd


def phase_reshard(c: Client, rank: int, root: str, workdir: Path) -> None:
    """Ranks 0 and 1 load the 4-rank checkpoint on a 2-rank mesh."""
    mesh2 = DeviceMesh("cpu", [0, 1])
    if rank < 2:
        model, opt, sd = fresh_state(mesh2)
        log("built on 2 ranks")
        dcp.load(sd, storage_reader=TierFSStorageReader(f"{root}/ckpt", client=c),
                 process_group=mesh2.get_group())
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        expected = torch.load(workdir / "expected.pt", weights_only=True)
        got = {k: full(v) for k, v in flat(sd).items()}
        assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
        for k, v in expected.items():
            assert same(got[k], v), f"resharded load: {k} differs"
    dist.barrier()


def phase_crash(c: Client, mesh: Any, rank: int, root: str, v1: dict[str, Any]) -> None:
    """v1 (the state dict of the first phase) is committed at crash/; a save
    of v2 there loses rank 2 midway."""
    dcp.save(v1, storage_writer=TierFSStorageWriter(f"{root}/crash", client=c))
    model, opt = build(mesh, seed=3)
    v2 = state(model, opt, mesh, seed=3)
    dist.barrier()
    log("v1 committed")
    if rank == 2:
        from tierfs.client import sync

        orig, sent = sync.File.write, [0]

        def dying_write(self: Any, data: Any) -> int:
            n = orig(self, data)
            sent[0] += n
            if sent[0] > 16 << 10:
                print("rank 2 dies mid-save", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return n

        sync.File.write = dying_write  # type: ignore[method-assign]
    try:
        dcp.save(v2, storage_writer=TierFSStorageWriter(f"{root}/crash", client=c))
    except BaseException as e:  # the group broke: expected for the survivors
        log(f"rank {rank} save failed as expected: {type(e).__name__}")
        print("OK crash", flush=True)
        os._exit(0)  # the group is broken: no orderly teardown
    raise AssertionError("the save survived a dead rank")


def main() -> None:
    rank, world, port, workdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    root = os.environ["DCP_ROOT"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    log(f"rank {rank}: group up")
    with Client() as c:
        sd = phase_save_and_interop(c, mesh, rank, root, workdir)
        dist.barrier()
        print("OK save", flush=True)
        phase_reshard(c, rank, root, workdir)
        log("OK reshard")
        phase_crash(c, mesh, rank, root, sd)


if __name__ == "__main__":
    main()
