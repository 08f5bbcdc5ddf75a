"""Authentication of every meta RPC, admin gating, users and tokens, the
node key, and the client's credential rules - against real ``tierfs-meta``
and ``tierfs-storage`` processes (docs/security.md).

Each refusal is checked to change nothing: the state digest (RPC sweep),
or the state the refused call would have changed."""

from __future__ import annotations

import asyncio
import functools
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.cluster import REPO, MetaCluster, session_credentials, wait_for
from tierfs.client import AsyncClient
from tierfs.errors import (
    PermissionDeniedError,
    TierFSError,
    UnauthenticatedError,
    from_grpc,
)
from tierfs.meta import MetaClient
from tierfs.meta.auth import ADMIN_RPCS, NODE_ONLY_RPCS, bearer, resolve_token
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.proto.v1 import storage_control_pb2 as spb
from tierfs.proto.v1 import storage_control_pb2_grpc as spb_grpc
from tierfs.security import admin_token, node_key, write_private_file

pytestmark = pytest.mark.timeout(120)

ADMIN = os.environ.get("TIERFS_TOKEN", "")
METHODS = pb.DESCRIPTOR.services_by_name["MetaService"].methods


@pytest.fixture(scope="module")
def meta(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetaCluster]:
    with MetaCluster(tmp_path_factory.mktemp("authn"), n=1, state_machine="meta") as c:
        c.wait_leader()
        yield c


def _mc(c: MetaCluster, token: str | None) -> MetaClient:
    return MetaClient(c.addresses, deadline=10, token=token)


def _call(addr: str, method: Any, token: str | None, metadata: tuple[tuple[str, str], ...] | None = None) -> None:
    """One raw call of ``method`` with an empty request; raises its TierFSError."""
    req_cls = getattr(pb, method.input_type.name)
    rep_cls = getattr(pb, method.output_type.name)
    with grpc.insecure_channel(addr) as ch:
        fn = ch.unary_unary(f"/tierfs.v1.MetaService/{method.name}", request_serializer=req_cls.SerializeToString,
                            response_deserializer=rep_cls.FromString)
        try:
            fn(req_cls(), timeout=5, metadata=metadata if metadata is not None else bearer(token))
        except grpc.RpcError as exc:
            raise from_grpc(exc) from None


async def _users(c: MetaCluster) -> tuple[str, str, str]:
    """A user with a revoked token, one with an expired token, one with a good one."""
    async with _mc(c, ADMIN) as mc:
        revoked = (await mc.add_user("rev", 2001, 2001)).token
        await mc.revoke_token("rev", all=True)
        expired = (await mc.add_user("exp", 2002, 2002, expires=0.5)).token
        good = (await mc.add_user("carol", 3001, 3001, [3002])).token
    return revoked, expired, good


def test_every_rpc_refuses_bad_credentials_and_changes_nothing(meta: MetaCluster) -> None:
    revoked, expired, good = asyncio.run(_users(meta))
    addr = meta.addresses[0]
    # the expiry is judged by the leader's op clock: wait until it has passed
    wait_for(lambda: _refused(addr, expired), 20, "the token to expire")
    digest = meta.wait_converged()
    other = admin_token(b"x" * 32)  # an admin token of another cluster
    bad: dict[str, tuple[str | None, tuple[tuple[str, str], ...] | None, str]] = {
        "no token": (None, None, "no credential"),
        "revoked": (revoked, None, "was revoked"),
        "expired": (expired, None, "expired"),
        "another cluster's": (other, None, "invalid admin token"),
        "malformed": (None, (("authorization", "Basic abc"),), "malformed credential"),
        "garbage": ("tfu1.nobody.short", None, "malformed user token"),
    }
    assert len(METHODS) >= 40
    for m in METHODS:
        for what, (tok, md, msg) in bad.items():
            with pytest.raises(UnauthenticatedError) as ei:
                _call(addr, m, tok, md)
            assert msg in str(ei.value), (m.name, what, str(ei.value))
    assert meta.wait_converged() == digest
    # control: a good token gets past the auth layer on every RPC (whatever the
    # empty request then earns: not UNAUTHENTICATED)
    for m in METHODS:
        if m.name in ("AddMetaMember", "RemoveMetaMember"):
            continue  # an empty membership change waits out its timeout
        try:
            _call(addr, m, ADMIN)
        except TierFSError as err:
            assert not isinstance(err, UnauthenticatedError), (m.name, err)
    assert good


def _refused(addr: str, token: str) -> bool:
    try:
        _call(addr, METHODS[0], token)
    except UnauthenticatedError as err:
        return "expired" in str(err)
    except TierFSError:
        return False
    return False


def test_user_identity_is_stamped_and_admin_ops_refused(meta: MetaCluster) -> None:
    async def go() -> None:
        async with _mc(meta, ADMIN) as mc:
            tok = (await mc.add_user("dave", 4001, 4002, [4003, 4004])).token
            await mc.mkdir("/dave-home", 0o755, 4001, 4002)  # / is root's 0755: dave works in his own
            await mc.create_kv_pool("keep", redundancy="replica:1", target_memory=1 << 20)
            users_before = [u.SerializeToString() for u in await mc.list_users()]
            pools_before = (await mc.list_kv_pools()).pools
        async with _mc(meta, tok) as user:
            me = await user.whoami()
            assert (me.name, me.uid, me.gid, list(me.groups), me.admin, me.kind) == \
                ("dave", 4001, 4002, [4003, 4004], False, "user")
            refused = {
                "DrainNode": user.drain_node(1), "UndrainNode": user.undrain_node(1), "RemoveNode": user.remove_node(1),
                "RemoveTarget": user.remove_target(1), "LabelNode": user.label_node(1, "r"),
                "CreateKVPool": user.create_kv_pool("mine", target_memory=1 << 20),
                "RemoveKVPool": user.remove_kv_pool("keep"), "AddUser": user.add_user("eve", 5, 5),
                "ListUsers": user.list_users(), "RemoveUser": user.remove_user("dave"),
                "IssueToken": user.issue_token("dave"), "RevokeToken": user.revoke_token("dave", all=True),
                "ForceSnapshot": user.force_snapshot(),
                "AddMetaMember": user.add_member("127.0.0.1:1", "127.0.0.1:2"),
                "AckGC": user.ack_gc([(1, 1)]), "FinishRebuild": user.finish_rebuild(1, 1),
                "Heartbeat": user.heartbeat(1, []),
                # every file's chunk keys, whatever its directory's mode, and the state's hash
                "ListGC": user.list_gc([1]), "ListGroupChunks": user.list_group_chunks(1),
                "Digest": user.digest(),
                "RegisterNode": user.register_node("u", "h", "127.0.0.1:1", [("/x", 1)]),
            }
            assert ADMIN_RPCS - {"RemoveMetaMember"} | NODE_ONLY_RPCS - {"MarkFragments"} <= set(refused)
            for name, coro in refused.items():
                with pytest.raises(PermissionDeniedError) as ei:
                    await coro
                assert name in str(ei.value), str(ei.value)
            # a user's ordinary work is fine, and runs as him (the op's caller)
            made = await user.mkdir("/dave-home/d")
            assert (made.attr.uid, made.attr.gid) == (4001, 4002)
        async with _mc(meta, ADMIN) as mc:
            assert [u.SerializeToString() for u in await mc.list_users()] == users_before
            assert (await mc.list_kv_pools()).pools == pools_before
            await mc.remove_kv_pool("keep")
            await mc.remove_user("dave")
        # removed: its token stops working at once
        async with _mc(meta, tok) as user:
            with pytest.raises(UnauthenticatedError, match="invalid token for user 'dave'"):
                await user.stat("/")

    asyncio.run(go())


def test_node_key_only_node_rpcs(meta: MetaCluster) -> None:
    secret = (meta.secret_file.read_text().strip()).encode()
    nk = node_key(secret)

    async def go() -> None:
        async with _mc(meta, nk) as node:
            assert (await node.whoami()).kind == "node"
            await node.get_cluster_map()
            await node.stat(1)  # the repair worker reads chunk records by inode
            for coro in (node.lookup(1, "x"), node.mkdir("/node-dir"), node.list_users(), node.drain_node(1)):
                with pytest.raises(PermissionDeniedError, match="node key"):
                    await coro

    asyncio.run(go())


def test_tokens_issue_and_revoke(meta: MetaCluster) -> None:
    async def go() -> None:
        async with _mc(meta, ADMIN) as mc:
            first = await mc.add_user("frank", 6001, 6001)
            second = await mc.issue_token("frank", expires=3600)
            assert second.token_id == first.token_id + 1 and second.token != first.token
            u = next(u for u in await mc.list_users() if u.name == "frank")
            assert [(t.id, t.revoked, bool(t.expires_ns)) for t in u.tokens] == [(1, False, False), (2, False, True)]
            assert b"tfu1" not in u.SerializeToString()  # only hashes are kept, never shown
            assert await mc.revoke_token("frank", first.token_id) == 1
        async with _mc(meta, first.token) as a, _mc(meta, second.token) as b:
            with pytest.raises(UnauthenticatedError, match="revoked"):
                await a.stat("/")
            assert (await b.whoami()).name == "frank"

    asyncio.run(go())


def _storage(tmp: Path, c: MetaCluster, key_file: str | None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TIERFS_TOKEN", "TIERFS_STORAGE_NODE_KEY_FILE")}
    env["PYTHONPATH"] = str(REPO)
    tmp.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "tierfs.storage.daemon", "--data-dir", str(tmp), "--io-backend", "posix",
            "--meta", c.addresses[0], "--heartbeat-interval", "0.2", "--reserved-bytes", "0"]
    if key_file is not None:
        args += ["--node-key-file", key_file]
    # stderr to a file: a test waits on what the daemon has logged so far
    # (a pipe is read only at its exit), and a long log never blocks it
    with open(tmp / "stderr.log", "w") as log:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=str(tmp))


def _log(tmp: Path) -> str:
    return (tmp / "stderr.log").read_text()


def test_rogue_storage_daemon_cannot_register(meta: MetaCluster, tmp_path: Path) -> None:
    """Without the node key, or with another cluster's, a storage daemon
    never registers (and so never heartbeats); with it, it does."""
    wrong = write_private_file(tmp_path / "wrong.key", node_key(b"y" * 32) + "\n")
    rogues = [tmp_path / "nokey", tmp_path / "wrong"]
    procs = [_storage(rogues[0], meta, None), _storage(rogues[1], meta, str(wrong))]
    good: subprocess.Popen[str] | None = None
    try:
        def nodes() -> list[str]:
            async def go() -> list[str]:
                async with _mc(meta, ADMIN) as mc:
                    return [n.data_addr for n in (await mc.get_cluster_map()).nodes]
            return asyncio.run(go())

        before = nodes()
        good = _storage(tmp_path / "good", meta, str(session_credentials() / "node.key"))
        assert good.stdout is not None
        ready = json.loads(good.stdout.readline())
        assert ready["node_id"]
        wait_for(lambda: len(nodes()) == len(before) + 1, 20, "the good daemon to register")
        # Each rogue has been refused at least once (on a loaded machine it may
        # still be starting when the good one registers: wait for its refusal,
        # never for a fixed time), and keeps trying without registering.
        def refused(tmp: Path) -> bool:
            return "registering with meta failed" in _log(tmp)

        for tmp in rogues:
            wait_for(functools.partial(refused, tmp), 60, f"{tmp.name}'s refusal")
        for p in procs:
            assert p.poll() is None  # still trying, refused
        assert len(nodes()) == len(before) + 1
        for p in procs:
            p.terminate()
            p.communicate(timeout=20)
        nokey, wrong_key = (_log(tmp) for tmp in rogues)
        # What to do, in the daemon's terms (until stop 48 the daemon without
        # a key repeated meta's advice to clients: TIERFS_TOKEN, --token-file).
        assert "registering with meta failed (no credential: this daemon has no node key" in nokey, nokey
        assert "--node-key-file" in nokey and "TIERFS_TOKEN" not in nokey, nokey
        assert "invalid node key" in wrong_key and f"(node key from {wrong})" in wrong_key, wrong_key
        # Scrub: admin only, checked with meta through WhoAmI
        control = ready["control"]

        async def scrub(token: str | None) -> spb.ScrubReport:
            async with grpc.aio.insecure_channel(control) as ch:
                try:
                    return await spb_grpc.StorageControlStub(ch).Scrub(  # type: ignore[no-untyped-call,no-any-return]
                        spb.ScrubRequest(repair=False), timeout=20, metadata=bearer(token))
                except grpc.RpcError as exc:
                    raise from_grpc(exc) from None

        async def user_token() -> str:
            async with _mc(meta, ADMIN) as mc:
                return (await mc.add_user("gina", 7001, 7001)).token

        tok = asyncio.run(user_token())
        with pytest.raises(PermissionDeniedError, match="Scrub is an admin operation"):
            asyncio.run(scrub(tok))
        # The CLI says it once, not as a table with the error on every node's row.
        from tierfs.cli.main import run

        out, err = io.StringIO(), io.StringIO()
        rc = run(["scrub", "--meta", meta.addresses[0]], stdout=out, stderr=err, env={"TIERFS_TOKEN": tok}, tty=False)
        assert rc == 1 and err.getvalue().count("\n") == 1 and "Scrub is an admin operation" in err.getvalue(), \
            (rc, out.getvalue(), err.getvalue())
        with pytest.raises(UnauthenticatedError):
            asyncio.run(scrub(None))
        assert asyncio.run(scrub(ADMIN)).node_id == ready["node_id"]
    finally:
        for p in [*procs, *([good] if good else [])]:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=20)


def test_default_credential_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_private_file(data / "admin.token", "tfa1.fromfile\n")
    write_private_file(tmp_path / "t", "tfu1.bob.fromtokenfile\n")
    env: dict[str, str] = {}
    assert resolve_token(data_dir=data, env=env) == "tfa1.fromfile"
    assert resolve_token(token_file=tmp_path / "t", data_dir=data, env=env) == "tfu1.bob.fromtokenfile"
    assert resolve_token(data_dir=data, env={"TIERFS_TOKEN_FILE": str(tmp_path / "t")}) == "tfu1.bob.fromtokenfile"
    assert resolve_token(data_dir=data, env={"TIERFS_TOKEN": "tfa1.env"}) == "tfa1.env"
    # given, even empty or wrong: never replaced by a default
    assert resolve_token("", data_dir=data, env={"TIERFS_TOKEN": "tfa1.env"}) == ""
    assert resolve_token("wrong", data_dir=data, env=env) == "wrong"
    assert resolve_token(data_dir=tmp_path / "none", env=env) is None


def test_explicit_wrong_token_is_not_replaced(meta: MetaCluster) -> None:
    """TIERFS_TOKEN holds the working admin token; a client given "" or a
    wrong token still fails instead of falling back to it."""
    assert os.environ["TIERFS_TOKEN"] == ADMIN

    async def go() -> None:
        for tok in ("", "tfa1.wrong"):
            async with AsyncClient(meta.addresses, token=tok, meta_deadline=5) as client:
                with pytest.raises(UnauthenticatedError):
                    await client.meta.stat("/")
        async with AsyncClient(meta.addresses, meta_deadline=5) as client:  # the default: TIERFS_TOKEN
            assert (await client.meta.whoami()).kind == "admin"

    asyncio.run(go())


def test_status_shows_security(meta: MetaCluster) -> None:
    assert meta.status(0).auth is True


@pytest.mark.timeout(60)
def test_insecure_no_auth_is_anonymous_and_visible(tmp_path: Path) -> None:
    with MetaCluster(tmp_path, n=1, state_machine="meta", extra_args=["--insecure-no-auth"]) as c:
        c.wait_leader()
        assert c.status(0).auth is False

        async def go() -> None:
            async with _mc(c, "") as anon:
                me = await anon.whoami()
                assert (me.kind, me.admin) == ("anonymous", True)
                await anon.create_kv_pool("anyone", target_memory=1 << 20)

        asyncio.run(go())
        assert "authentication is OFF" in c.log(0)


def test_auth_needs_the_cluster_secret(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERFS_META_")}
    env["PYTHONPATH"] = str(REPO)
    res = subprocess.run([sys.executable, "-m", "tierfs.meta.daemon", "--data-dir", str(tmp_path / "d"),
                          "--insecure-no-cluster-secret"], capture_output=True, env=env, timeout=30)
    assert res.returncode == 2 and b"auth = true needs the cluster secret" in res.stderr, res.stderr


def test_cli_user_commands_and_token_file(meta: MetaCluster, tmp_path: Path) -> None:
    from tierfs.cli import run

    def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        rc = run([*args, "--meta", meta.addresses[0]], stdout=out, stderr=err,
                 env={"TIERFS_TOKEN": ADMIN} if env is None else env, tty=False)
        return rc, out.getvalue(), err.getvalue()

    rc, out, err = cli("whoami")
    assert rc == 0 and out.startswith("root (admin): uid 0 gid 0"), out  # "(admin, admin)" until stop 44
    rc, out, err = cli("user", "add", "hank", "--uid", "8001", "--gid", "8002", "--groups", "1,,2")
    assert rc == 2 and "not a comma-separated list of gids" in err, err  # a typo, not groups 1 and 2
    rc, out, err = cli("user", "add", "hank", "--uid", str(2**32 - 1), "--gid", "8002")
    assert rc == 2 and "ids are numbers from 0 to 4294967294" in err, err  # (uid_t)-1 is "no uid"
    rc, out, err = cli("user", "add", "hank", "--uid", "8001", "--gid", "8002", "--expires", "-1d")
    assert rc == 2 and "not a lifetime: '-1d' (a lifetime is not negative" in err, err  # not "expected one argument"
    rc, out, err = cli("user", "add", "hank", "--uid", "8001", "--gid", "8002", "--groups", "1,2", "--expires", "30d")
    assert rc == 0, err
    # the token alone on stdout (TIERFS_TOKEN=$(tierfs user add ...) took the note too), the note on stderr
    token = out.strip()
    assert token.startswith("tfu1.hank.") and out == token + "\n" and "shown once" in err, (out, err)
    rc, out, _ = cli("user", "ls")
    assert rc == 0 and "hank" in out and "8001" in out
    # TIERFS_TOKEN holding more than the token: a clear error, not gRPC's "Illegal header value"
    for bad in (token + "\n# token 1 of user hank", "tfu1.hank.\u00e9"):
        rc, _, err = cli("whoami", env={"TIERFS_TOKEN": bad})
        assert rc == 1 and "$TIERFS_TOKEN does not hold one token" in err and "Traceback" not in err, err
    rc, out, err = cli("whoami", env={"TIERFS_TOKEN": f"  {token}\n"})  # surrounding whitespace is dropped
    assert rc == 0 and out.startswith("hank (user)"), (out, err)
    f = write_private_file(tmp_path / "hank.token", token + "\n")
    rc, out, err = cli("whoami", "--token-file", str(f))
    assert rc == 0 and out.startswith("hank (user): uid 8001 gid 8002 groups 1,2"), (out, err)
    rc, _, err = cli("user", "ls", "--token-file", str(f))
    assert rc == 1 and "ListUsers is an admin operation" in err
    # a wrong token given explicitly is not replaced by TIERFS_TOKEN
    wrong = write_private_file(tmp_path / "wrong.token", "tfa1.wrong\n")
    rc, _, err = cli("ls", "/", "--token-file", str(wrong))
    assert rc == 1 and "invalid admin token" in err
    # no credential at all (no TIERFS_TOKEN, no --data admin.token)
    rc, _, err = cli("ls", "/", "--data", str(tmp_path), env={})
    assert rc == 1 and "no credential" in err
    # status too: it said "cluster unreachable ... is the cluster running?"
    rc, _, err = cli("status", env={})
    assert rc == 1 and err.startswith("tierfs: no credential") and "unreachable" not in err, err
    rc, _, err = cli("status", "--token-file", str(wrong))
    assert rc == 1 and err.startswith("tierfs: invalid admin token") and "unreachable" not in err, err
    rc, out, _ = cli("status")
    assert "security: on" in out
    rc, out, _ = cli("user", "revoke", "hank", "--all")
    assert rc == 0 and "revoked 1 token" in out
    rc, out, _ = cli("user", "ls")
    assert rc == 0 and "0/1" in out and "1:revoked" in out, out  # revoked tokens are shown as such
    rc, _, err = cli("whoami", "--token-file", str(f))
    assert rc == 1 and "revoked" in err
    rc, out, _ = cli("user", "rm", "hank")
    assert rc == 0


@pytest.mark.timeout(60)
def test_a_credential_file_rewritten_while_read_is_never_seen_empty(tmp_path: Path) -> None:
    """``tierfs up`` (``LocalCluster``) rewrites ``admin.token`` and
    ``node.key`` on every start, while daemons that are restarting and
    clients read them. The rewrite used to truncate the file in place, so
    a reader could find it empty: a storage daemon restarted by the KV
    checker soak (seed 204) exited with "node key file ... does not hold
    one token" while the meta nemesis restarted a meta replica. The file is
    now replaced whole (a temporary file renamed over it): a reader sees
    the old token or the new one, never a part."""
    import threading

    from tierfs.security import load_token_file

    path = tmp_path / "node.key"
    keys = [node_key(bytes([i]) * 32) for i in range(2)]
    write_private_file(path, keys[0] + "\n")
    stop = threading.Event()
    errors: list[str] = []

    def read() -> None:
        while not stop.is_set():
            try:
                if load_token_file(path, "node key") not in keys:
                    errors.append("a token that was never written")
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            if errors:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        for i in range(2000):
            write_private_file(path, keys[i % 2] + "\n", overwrite=True)
            if errors:
                break
    finally:
        stop.set()
        reader.join(10)
    assert errors == [], errors[0]
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in tmp_path.iterdir()] == ["node.key"]  # no temporary file left


def test_cli_chmod_and_chown_give_a_user_a_directory(meta: MetaCluster, tmp_path: Path) -> None:
    """An admin makes a directory a user may write, with `tierfs chmod`
    and `tierfs chown` (a new operator's find: until stop 44 neither the
    CLI nor the Python client could, only a FUSE mount); the user's own
    chmod and chown follow chmod(2)/chown(2)'s rules; bad modes and owners
    are usage errors (exit 2) that change nothing."""
    from tierfs.cli import run

    def cli(*args: str, token: Path | None = None) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        extra = ["--token-file", str(token)] if token is not None else []
        rc = run([*args, "--meta", meta.addresses[0], *extra], stdout=out, stderr=err,
                 env={"TIERFS_TOKEN": ADMIN}, tty=False)
        return rc, out.getvalue(), err.getvalue()

    rc, out, err = cli("user", "add", "ivy", "--uid", "8101", "--gid", "8102")
    assert rc == 0, err
    ivy = write_private_file(tmp_path / "ivy.token", out.splitlines()[0] + "\n")
    assert cli("mkdir", "/team", "/shared")[0] == 0
    rc, _, err = cli("mkdir", "/team/x", token=ivy)
    assert rc == 1 and "permission" in err.lower(), err  # root's 755 directory
    assert cli("chown", "8101:8102", "/team")[0] == 0
    assert cli("chmod", "1777", "/shared")[0] == 0
    st = json.loads(cli("stat", "/team", "--json")[1])
    assert (st["uid"], st["gid"]) == (8101, 8102)
    assert int(json.loads(cli("stat", "/shared", "--json")[1])["mode"], 8) & 0o7777 == 0o1777
    assert cli("mkdir", "/team/x", "/shared/y", token=ivy)[0] == 0
    assert cli("chmod", "700", "/team/x", token=ivy)[0] == 0  # her own
    rc, _, err = cli("chown", "0", "/team/x", token=ivy)  # only root gives a file away
    assert rc == 1, err
    rc, _, err = cli("chmod", "755", "/", token=ivy)  # not hers
    assert rc == 1, err
    for args in (("chmod", "8", "/team"), ("chmod", "17777", "/team"), ("chmod", "rwx", "/team"),
                 ("chown", "alice", "/team"), ("chown", ":", "/team"), ("chown", "-1", "/team")):
        rc, _, err = cli(*args)
        assert rc == 2 and "tierfs ch" in err, (args, err)
    st = json.loads(cli("stat", "/team", "--json")[1])
    assert (st["uid"], st["gid"], int(st["mode"], 8) & 0o7777) == (8101, 8102, 0o755)
    rc, _, err = cli("chmod", "755", "/nope", "/shared")  # each path on its own
    assert rc == 1 and "/nope" in err, err


def test_a_lifetime_under_a_millisecond_is_not_never(meta: MetaCluster) -> None:
    """``expires`` is seconds and 0 means never; a positive lifetime that is
    under 1 ms once in ms (``--expires 0.0004``) is 1 ms, not 0 (until stop
    48 such a token never expired)."""
    async def go() -> None:
        async with _mc(meta, ADMIN) as mc:
            for step in range(2):
                r = await (mc.add_user("tiny", 7001, 7001, expires=0.0004) if step == 0
                           else mc.issue_token("tiny", expires=0.0001))
                t = next(t for t in r.user.tokens if t.id == r.token_id)
                assert t.expires_ns - t.created_ns == 1_000_000
                async with _mc(meta, r.token) as c:
                    with pytest.raises(UnauthenticatedError, match=f"token {r.token_id} of user 'tiny' expired"):
                        await c.whoami()

    asyncio.run(go())


def test_a_forgotten_dead_token_is_not_called_never_issued(meta: MetaCluster) -> None:
    """A new token drops the user's expired and revoked ones from its record;
    the dropped token's refusal still says it may have expired or been
    revoked (until stop 48: "not one meta issued, or the user was removed
    or never added", about a token meta had issued)."""
    async def go() -> None:
        async with _mc(meta, ADMIN) as mc:
            old = await mc.add_user("forgot", 7101, 7101, expires=0.001)
            async with _mc(meta, old.token) as c:
                with pytest.raises(UnauthenticatedError, match="token 1 of user 'forgot' expired"):
                    await c.whoami()
            await mc.issue_token("forgot")
            assert [t.id for t in next(u for u in await mc.list_users() if u.name == "forgot").tokens] == [2]
            async with _mc(meta, old.token) as c:
                with pytest.raises(UnauthenticatedError, match="expired or was revoked"):
                    await c.whoami()

    asyncio.run(go())
