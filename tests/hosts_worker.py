"""A client program for a client host of tests/hosts.py (run there with
``ip netns exec``; the meta addresses, token and TLS files come from the
environment, TIERFS_META / TIERFS_TOKEN_FILE / TIERFS_TLS_*, as a deployed
client gets them). Prints one JSON object on its last stdout line.

    write  --dir D --files N --size S --seed X   write N files, read each back
           [--redundancy ec:K+M --chunk-size B]  (the layout of D)
    verify --manifest FILE                       read every file of a manifest
    reread --manifest FILE --stop FILE           read every file of a manifest, again and
           --max-seconds T                       again, until FILE exists (or T)
    netns                                        which network namespace this runs in
    loop   --dir D --size S --stop FILE --max-seconds T
           write then read back file after file until FILE exists (or T);
           one JSON line per operation (kept in the answer too)

A manifest (the answer of ``write`` and ``loop``): ``{"files": {path: sha256}}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

import numpy as np

from tierfs.client import Client
from tierfs.errors import TierFSError


def _data(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _client(args: argparse.Namespace) -> Client:
    return Client(request_timeout=args.request_timeout, connect_timeout=1.0, lease_ms=args.lease_ms)


def _mkdir(c: Client, args: argparse.Namespace) -> None:
    c.mkdir(args.dir, parents=True, exist_ok=True)
    if args.redundancy or args.chunk_size:
        c.set_layout(args.dir, redundancy=args.redundancy, chunk_size=args.chunk_size)


def _write(args: argparse.Namespace) -> dict[str, Any]:
    files: dict[str, str] = {}
    with _client(args) as c:
        _mkdir(c, args)
        for i in range(args.files):
            path = f"{args.dir}/f{i}"
            data = _data(args.size + i, args.seed + i)
            c.write_bytes(path, data)
            got = c.read_bytes(path)
            if got != data:
                raise SystemExit(f"{path}: read back {len(got)} bytes that differ from the {len(data)} written")
            files[path] = hashlib.sha256(data).hexdigest()
    return {"files": files}


def _verify(args: argparse.Namespace) -> dict[str, Any]:
    with open(args.manifest) as f:
        files: dict[str, str] = json.load(f)["files"]
    bad = {}
    with _client(args) as c:
        for path, want in sorted(files.items()):
            got = hashlib.sha256(c.read_bytes(path)).hexdigest()
            if got != want:
                bad[path] = got
    return {"checked": len(files), "bad": bad}


def _loop(args: argparse.Namespace) -> dict[str, Any]:
    files: dict[str, str] = {}
    ops: list[dict[str, Any]] = []
    t_end = time.monotonic() + args.max_seconds
    with _client(args) as c:
        _mkdir(c, args)
        i = 0
        while not os.path.exists(args.stop) and time.monotonic() < t_end:
            path = f"{args.dir}/l{i}"
            data = _data(args.size, args.seed + i)
            t0 = time.monotonic()
            op: dict[str, Any] = {"i": i, "t": time.time()}
            try:
                c.write_bytes(path, data)
                files[path] = hashlib.sha256(data).hexdigest()
                if c.read_bytes(path) != data:
                    raise SystemExit(f"{path}: read back differs from what was acknowledged")
                op["ok"] = True
            except TierFSError as exc:
                op.update(ok=False, err=f"{type(exc).__name__}: {exc}")
            op["s"] = round(time.monotonic() - t0, 3)
            ops.append(op)
            print(json.dumps(op), flush=True)
            i += 1
    return {"files": files, "ops": ops}


def _reread(args: argparse.Namespace) -> dict[str, Any]:
    with open(args.manifest) as f:
        files: dict[str, str] = json.load(f)["files"]
    rounds, errors, bad = 0, [], {}
    t_end = time.monotonic() + args.max_seconds
    with _client(args) as c:
        while not os.path.exists(args.stop) and time.monotonic() < t_end:
            for path, want in sorted(files.items()):
                try:
                    got = hashlib.sha256(c.read_bytes(path)).hexdigest()
                except TierFSError as exc:
                    errors.append(f"{path}: {type(exc).__name__}: {exc}")
                    continue
                if got != want:
                    bad[path] = got
            rounds += 1
            print(json.dumps({"round": rounds, "t": time.time(), "errors": len(errors), "bad": len(bad)}), flush=True)
    return {"rounds": rounds, "errors": errors, "bad": bad}


def _netns(args: argparse.Namespace) -> dict[str, Any]:
    return {"netns": os.readlink("/proc/self/ns/net")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hosts_worker")
    p.add_argument("cmd", choices=["write", "verify", "loop", "reread", "netns"])
    p.add_argument("--dir", default="/hosts")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--size", type=int, default=1 << 20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--redundancy", default="", help="layout of --dir (default: the cluster's)")
    p.add_argument("--chunk-size", type=int, default=0)
    p.add_argument("--manifest", default="")
    p.add_argument("--stop", default="")
    p.add_argument("--max-seconds", type=float, default=60.0)
    p.add_argument("--request-timeout", type=float, default=2.0)
    p.add_argument("--lease-ms", type=int, default=6000)
    args = p.parse_args(argv)
    out = {"write": _write, "verify": _verify, "loop": _loop, "reread": _reread, "netns": _netns}[args.cmd](args)
    out["netns"] = os.readlink("/proc/self/ns/net")  # where it ran: the test checks it is not its own
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
