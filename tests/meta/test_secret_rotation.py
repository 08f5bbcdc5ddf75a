"""Rotating the cluster secret on a running cluster (docs/security.md,
"Rotating the cluster secret"): the secret file's three steps (``add``,
``promote``, ``retire`` of ``python -m tierfs.meta.secret``), each followed
by a rolling restart, move every replica and daemon to a new secret with no
downtime; afterwards nothing made from the old secret passes (admin token,
capabilities, Raft frames)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import pickle
import time
import zlib
from pathlib import Path

import pytest

from tierfs import capability as capmod
from tierfs.client import AsyncClient
from tierfs.errors import ConfigError, NotFoundError, UnauthenticatedError
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient
from tierfs.meta.auth import Authenticator
from tierfs.meta.raft import FrameSealer
from tierfs.meta.secret import (
    add_secret,
    load_secret,
    load_secrets,
    main,
    promote_secret,
    retire_secrets,
)
from tierfs.net import DataClient
from tierfs.security import admin_token, node_key
from tierfs.storage.api import FragmentKey

OLD, NEW = b"o" * 64, b"n" * 64


def _write(p: Path, text: str, mode: int = 0o600) -> Path:
    p.write_text(text)
    os.chmod(p, mode)
    return p


def test_secret_file_steps(tmp_path: Path) -> None:
    f = _write(tmp_path / "s", "a" * 40 + "\n")
    assert load_secrets(f) == [b"a" * 40]
    found = add_secret(f)
    assert len(found) == 2 and found[0] == b"a" * 40 and len(found[1]) == 64
    assert load_secret(f) == b"a" * 40  # the current one is still the old
    assert promote_secret(f) == [found[1], b"a" * 40]
    assert load_secret(f) == found[1]
    assert retire_secrets(f) == [found[1]]
    assert oct(f.stat().st_mode & 0o777) == "0o600"
    # Bad files change nothing and say why.
    for text, why in (("a" * 40 + "\n" + "a" * 40, "same secret twice"),
                      ("a" * 40 + "\nshort\n", "line 2 of"),
                      ("\n".join(c * 40 for c in "abcd"), "at most 3"),
                      ("\n\n", "0 characters")):
        bad = _write(tmp_path / "bad", text)
        with pytest.raises(ConfigError, match=why):
            load_secrets(bad)
    one = _write(tmp_path / "one", "b" * 40)
    with pytest.raises(ConfigError, match="add a new one first"):
        promote_secret(one)
    add_secret(one)
    add_secret(one)
    with pytest.raises(ConfigError, match="finish the rotation"):
        add_secret(one)
    assert main(["promote", str(one)]) == 0 and main(["retire", str(one)]) == 0 and len(load_secrets(one)) == 1
    assert main(["rotate", str(one)]) == 2


def test_accepted_secrets_open_frames_and_pass_tokens_and_capabilities() -> None:
    from cryptography.exceptions import InvalidTag

    data = zlib.compress(pickle.dumps({"type": "append_entries", "term": 1}))
    old, new = FrameSealer(OLD), FrameSealer(NEW)
    both_old_first, both_new_first = FrameSealer(OLD, accepted=[NEW]), FrameSealer(NEW, accepted=[OLD])
    for sealer in (both_old_first, both_new_first):
        for src in (old, new):
            assert sealer.decrypt(src.encrypt_at_time(data, 7)) == data
    # Each seals with its current secret only: a replica that retired the
    # other one no longer opens its frames.
    assert new.decrypt(both_new_first.encrypt_at_time(data, 7)) == data
    with pytest.raises(InvalidTag):
        old.decrypt(both_new_first.encrypt_at_time(data, 7))
    with pytest.raises(InvalidTag):
        new.decrypt(old.encrypt_at_time(data, 7))

    auth = Authenticator(NEW, [OLD])
    now = time.time_ns
    for s in (OLD, NEW):
        assert auth.identify(admin_token(s), {}, now).uid == 0
        auth.identify(node_key(s), {}, now)
    with pytest.raises(UnauthenticatedError):
        Authenticator(NEW).identify(admin_token(OLD), {}, now)

    # A daemon's keyring from meta's list: the accepted secrets' keys first,
    # the current one's last (kept as the one it signs with).
    epoch = 5
    ring = capmod.Keyring([*capmod.keys_around(OLD, epoch).items(), *capmod.keys_around(NEW, epoch).items()])
    assert ring.keys[epoch] == capmod.epoch_key(NEW, epoch)
    for s in (OLD, NEW):
        cap = capmod.mint(capmod.epoch_key(s, epoch), kind=capmod.KIND_FILE, ops=capmod.OP_READ, epoch=epoch,
                          scope=1, principal=0, expiry_ms=10**15)
        assert capmod.verify(ring, 0, capmod.encode(cap)).scope == 1
        only_new = capmod.Keyring(capmod.keys_around(NEW, epoch))
        if s == OLD:
            with pytest.raises(UnauthenticatedError):
                capmod.verify(only_new, 0, capmod.encode(cap))


def _node_cap(secret: bytes) -> bytes:
    now = int(time.time() * 1000)
    epoch = capmod.epoch_at(now, 3600.0)
    return capmod.encode(capmod.mint(capmod.epoch_key(secret, epoch), kind=capmod.KIND_NODE,
                                     ops=capmod.OP_READ, epoch=epoch, scope=0, principal=0,
                                     expiry_ms=now + 600_000))


@pytest.mark.timeout(240)
def test_rotation_with_rolling_restarts_keeps_the_cluster_serving(tmp_path: Path) -> None:
    cl = LocalCluster(tmp_path / "c", n_meta=3, n_storage=3)
    files: dict[str, str] = {}
    metas = [p.name for p in cl.procs if p.kind == "meta"]
    storages = [p.name for p in cl.procs if p.kind == "storage"]

    async def write_read(name: str, first: bool = False) -> None:
        # This cluster's own admin token as it is now (the suite exports a shared
        # one as TIERFS_TOKEN, made from the secret this test rotates away).
        async with AsyncClient(cl.meta_addrs, transport="tcp", token=cl.admin_token(), meta_deadline=20.0) as c:
            if first:
                await c.mkdir("/r", exist_ok=True)
                await c.set_layout("/r", chunk_size=256 * 1024, redundancy="ec:2+1")
            data = os.urandom(700 * 1024 + len(files))
            await c.write_bytes(f"/r/{name}", data)
            files[f"/r/{name}"] = hashlib.sha256(data).hexdigest()
            for path, digest in files.items():  # everything acknowledged so far
                assert hashlib.sha256(await c.read_bytes(path)).hexdigest() == digest, path

    def rolling(names: list[str], between: str) -> None:
        for n in names:
            cl.stop(names=[n])
            cl.start(names=[n], timeout=60)
            asyncio.run(cl.wait_healthy(60))
            asyncio.run(write_read(f"{between}-{n}"))

    try:
        cl.up(timeout=90)
        asyncio.run(write_read("before", first=True))
        old = load_secret(cl.secret_file)

        add_secret(cl.secret_file)  # step 1: the new one accepted everywhere
        new = load_secrets(cl.secret_file)[1]
        rolling(metas, "add")
        promote_secret(cl.secret_file)  # step 2: the new one current, replica by replica
        rolling(metas, "promote")  # writes in the mixed phases: both keys pass everywhere
        assert cl.admin_token() == admin_token(new)
        # The daemons take the new node key (all at once: what matters is
        # that meta accepts it; a rolling restart works the same way).
        cl.stop(names=storages)
        cl.start(names=storages, timeout=60)
        asyncio.run(cl.wait_healthy(60))
        asyncio.run(write_read("node-key"))
        retire_secrets(cl.secret_file)  # step 3: the old one gone
        rolling(metas, "retire")
        assert load_secrets(cl.secret_file) == [new]

        async def old_refused() -> None:
            async with MetaClient(cl.meta_addrs, deadline=3.0, token=admin_token(old)) as mc:
                with pytest.raises(UnauthenticatedError):
                    await mc.get_cluster_map()
            async with MetaClient(cl.meta_addrs, deadline=5.0, token=admin_token(new)) as mc:
                cmap = await mc.get_cluster_map()
            node = cmap.nodes[0]
            target = node.target_ids[0]
            key = FragmentKey(987654321, 0, 0, 0)
            for secret, want in ((old, UnauthenticatedError), (new, NotFoundError)):
                async with DataClient(transport="tcp", routes={target: node.data_addr}, connect_timeout=2.0,
                                      request_timeout=5.0) as dc:
                    dc.caps.add(_node_cap(secret))
                    with pytest.raises(want):
                        await dc.stat(target, key)

        asyncio.run(old_refused())
        # No replica was left behind: all three at one term's leader, every file exact.
        asyncio.run(write_read("after"))
        h = asyncio.run(cl.health())
        assert sorted(m["role"] for m in h["meta"]) == ["follower", "follower", "leader"], h["meta"]
    finally:
        cl.stop()
