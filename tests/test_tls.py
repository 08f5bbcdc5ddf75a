"""TLS end to end: a local cluster made with ``tls=True`` (``tierfs up
--tls``: a local CA, one certificate per daemon, mutual TLS on the meta and
storage-control gRPC ports and on the TCP data plane) serves the client and
the CLI that find DIR/tls/ by themselves, and refuses a plaintext client, a
client trusting another CA and a client without a certificate. A plaintext
frame thrown at a TLS data port gets nothing served."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tierfs.cli import run
from tierfs.client import AsyncClient
from tierfs.errors import UnavailableError
from tierfs.local import LocalCluster
from tierfs.meta import MetaClient
from tierfs.net import MAGIC, DataClient, Op, encode_header
from tierfs.net.protocol import HEADER_SIZE
from tierfs.storage.api import FragmentKey
from tierfs.tls import TlsFiles, issue, make_local_ca, resolve_client_tls

KiB = 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cl = LocalCluster(tmp_path_factory.mktemp("tls") / "cluster", n_meta=1, n_storage=3, tls=True)
    try:
        cl.up(timeout=60)
        yield cl
    finally:
        cl.stop()


def _client(cl: LocalCluster, **kw: str) -> AsyncClient:
    tls = cl.client_tls()
    assert tls is not None
    opts = {"tls_ca": tls.ca, "tls_cert": tls.cert, "tls_key": tls.key, **kw}
    return AsyncClient(cl.meta_addrs, transport="tcp", meta_deadline=3.0, meta_attempt_timeout=1.0,
                       connect_timeout=2.0, **opts)


@pytest.mark.timeout(30)
def test_local_ca_files(cluster: LocalCluster) -> None:
    d = cluster.tls_dir
    names = {"ca", "client", *(p.name for p in cluster.procs)}
    for name in names:
        assert (d / f"{name}.pem").is_file()
        assert stat.S_IMODE((d / f"{name}.key").stat().st_mode) == 0o600, name
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    # Reopening the directory keeps it a TLS cluster (and keeps the CA).
    ca = (d / "ca.pem").read_bytes()
    again = LocalCluster(cluster.dir)
    assert again.tls and again.client_tls() == cluster.client_tls()
    assert (d / "ca.pem").read_bytes() == ca
    # Every daemon said it serves mutual TLS.
    for p in cluster.procs:
        assert '"tls": "mutual"' in (cluster.dir / "logs" / f"{p.name}.out").read_text(), p.name


@pytest.mark.timeout(40)
def test_client_writes_and_reads_over_tls(cluster: LocalCluster) -> None:
    async def go() -> None:
        data = os.urandom(300 * KiB)
        async with _client(cluster) as c:
            await c.mkdir("/tls", exist_ok=True)
            await c.set_layout("/tls", chunk_size=64 * KiB, redundancy="ec:2+1")
            await c.write_bytes("/tls/a", data)
            assert await c.read_bytes("/tls/a") == data
            assert c._data is not None and c._data.tls is not None  # the data plane, not only meta

    asyncio.run(go())


@pytest.mark.timeout(40)
def test_cli_finds_the_local_ca(cluster: LocalCluster, tmp_path: Path) -> None:
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(100 * KiB))

    def cli(*args: str) -> tuple[int, str]:
        err = io.StringIO()
        rc = run([*args, "--data", str(cluster.dir)], stdout=io.StringIO(), stderr=err, env={}, tty=False)
        return rc, err.getvalue()

    assert cli("mkdir", "-p", "/tls-cli")[0] == 0
    rc, err = cli("set-layout", "/tls-cli", "--redundancy", "ec:2+1")
    assert rc == 0, err
    rc, err = cli("put", str(src), "/tls-cli/f.bin")
    assert rc == 0, err
    rc, err = cli("get", "/tls-cli/f.bin", str(tmp_path / "out.bin"))
    assert rc == 0, err
    assert (tmp_path / "out.bin").read_bytes() == src.read_bytes()
    # The same cluster, named by --meta alone and not --data: no CA found, plaintext refused.
    err_io = io.StringIO()
    rc = run(["ls", "/", "--meta", cluster.meta_addrs[0], "--timeout", "2"], stdout=io.StringIO(),
             stderr=err_io, env={}, tty=False)
    assert rc != 0 and "unreachable" in err_io.getvalue()


def _server_only_cert(ca_dir: Path, out: Path) -> tuple[Path, Path]:
    """A certificate of the cluster's CA good for a server only (extended
    key usage serverAuth, as some CAs issue by default)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "server-only")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem, key_path = out / "server-only.pem", out / "server-only.key"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return pem, key_path


@pytest.mark.timeout(40)
def test_a_certificate_without_client_auth_is_named(cluster: LocalCluster, tmp_path: Path) -> None:
    """A daemon's certificate from the operator's own CA with serverAuth
    alone (no clientAuth) is refused by a mutual-TLS meta when the daemon
    dials it: the error says that, not "another CA, or expired" (a storage
    daemon set up by hand that way logged only that, and never registered)."""
    tls = cluster.client_tls()
    assert tls is not None
    pem, key = _server_only_cert(cluster.dir / "tls", tmp_path)

    async def go() -> str:
        async with MetaClient(cluster.meta_addrs, deadline=2.0, attempt_timeout=1.0,
                              tls=TlsFiles(ca=tls.ca, cert=str(pem), key=str(key))) as mc:
            with pytest.raises(UnavailableError) as info:
                await mc.get_cluster_map()
        return str(info.value)

    msg = asyncio.run(go())
    assert f"did not accept the client's ({pem})" in msg and "lacks clientAuth" in msg, msg


@pytest.mark.timeout(40)
def test_wrong_clients_are_refused(cluster: LocalCluster, tmp_path: Path) -> None:
    tls = cluster.client_tls()
    assert tls is not None
    other_ca = str(make_local_ca(tmp_path / "other"))

    async def refused(with_tls: TlsFiles | None) -> str:
        async with MetaClient(cluster.meta_addrs, deadline=2.0, attempt_timeout=1.0, tls=with_tls) as mc:
            with pytest.raises(UnavailableError) as info:
                await mc.get_cluster_map()
        return str(info.value)

    async def go() -> None:
        # Plaintext to a TLS port, a server certificate no trusted CA signed,
        # no client certificate where one is required: none gets an answer.
        msg = await refused(None)
        assert "cluster unreachable" in msg and "give the client its CA" in msg, msg
        msg = await refused(TlsFiles(ca=other_ca))
        assert "CERTIFICATE_VERIFY_FAILED" in msg and f"client's CA ({other_ca})" in msg, msg
        msg = await refused(TlsFiles(ca=tls.ca))
        assert "give the client one (TIERFS_TLS_CERT" in msg, msg
        # A client certificate of another CA: the server drops it too, and
        # the message says so (until stop 47 it ended at "Socket closed").
        pem, key = issue(tmp_path / "other", "client", client_only=True)
        msg = await refused(TlsFiles(ca=tls.ca, cert=str(pem), key=str(key)))
        assert f"did not accept the client's ({pem})" in msg, msg
        # The CLI says it in its own words only: gRPC core logged each failed
        # handshake at INFO on stderr, ten lines before them (until stop 48).
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TIERFS_", "GRPC_"))}
        env.update(TIERFS_TLS_CA=other_ca, TIERFS_TOKEN_FILE=str(cluster.admin_token_file))
        r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "tierfs.cli", "ls", "/", "--meta",
                                                     cluster.meta_addrs[0], "--timeout", "3"],
                                    capture_output=True, text=True, env=env, cwd="/", timeout=60)
        assert r.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in r.stderr, r.stderr
        assert "Handshake failed" not in r.stderr and r.stderr.count("\n") <= 2, r.stderr
        # A server that refused the handshake is running: no "is the cluster
        # running?" after the TLS reason (until stop 49 every refusal had it).
        assert "is the cluster running" not in r.stderr, r.stderr
        env.update(TIERFS_TLS_CA=tls.ca, TIERFS_TLS_CERT=str(pem), TIERFS_TLS_KEY=str(key))
        r = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "tierfs.cli", "ls", "/", "--meta",
                                                     cluster.meta_addrs[0], "--timeout", "3"],
                                    capture_output=True, text=True, env=env, cwd="/", timeout=60)
        assert r.returncode == 1 and f"did not accept the client's ({pem})" in r.stderr, r.stderr
        assert "is the cluster running" not in r.stderr, r.stderr
        # The data plane likewise: the client checks the server against its CA.
        async with MetaClient(cluster.meta_addrs, deadline=5.0, tls=tls) as mc:
            cmap = await mc.get_cluster_map()
        node = cmap.nodes[0]
        route = {node.target_ids[0]: node.data_addr}
        target = node.target_ids[0]
        async with DataClient(transport="tcp", routes=route, connect_timeout=2.0, request_timeout=2.0,
                              tls=TlsFiles(ca=other_ca).client_ssl_context()) as dc:
            with pytest.raises(UnavailableError, match="certificate verify failed"):
                await dc.ping(target)
        # The server's certificate is fine, but the client has none to show.
        async with DataClient(transport="tcp", routes=route, connect_timeout=2.0, request_timeout=2.0,
                              tls=TlsFiles(ca=tls.ca).client_ssl_context()) as dc:
            with pytest.raises(UnavailableError):
                await dc.ping(target)
        async with DataClient(transport="tcp", routes=route, connect_timeout=2.0,
                              tls=tls.client_ssl_context()) as dc:
            await dc.ping(target)

    asyncio.run(go())


@pytest.mark.timeout(30)
def test_plaintext_frame_to_a_tls_data_port_gets_nothing(cluster: LocalCluster) -> None:
    storage = next(p for p in cluster.procs if p.kind == "storage")
    host, _, port = storage.addr.rpartition(":")
    buf = bytearray(HEADER_SIZE)
    encode_header(buf, Op.PING, 1, key=FragmentKey(0, 0, 0, 0))
    got = b""
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(bytes(buf))
        s.shutdown(socket.SHUT_WR)
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(1 << 16):
                got += chunk
    # At most a TLS alert; never a frame.
    assert MAGIC not in got, got[:64]


@pytest.mark.timeout(10)
def test_client_tls_resolution(tmp_path: Path) -> None:
    (tmp_path / "tls").mkdir()
    assert resolve_client_tls(data_dir=tmp_path, env={}) is None
    (tmp_path / "tls" / "ca.pem").write_text("x")
    found = resolve_client_tls(data_dir=tmp_path, env={})
    assert found == TlsFiles(ca=str(tmp_path / "tls" / "ca.pem"))
    # The environment beats the local directory; an explicit "" means plaintext.
    assert resolve_client_tls(data_dir=tmp_path, env={"TIERFS_TLS_CA": "/e/ca.pem"}) == TlsFiles(ca="/e/ca.pem")
    assert resolve_client_tls("", data_dir=tmp_path, env={"TIERFS_TLS_CA": "/e/ca.pem"}) is None
    # With the addresses about to be dialled: only for that local cluster's own.
    (tmp_path / "cluster.toml").write_text('[cluster]\nmeta = ["127.0.0.1:7000"]\n')
    assert resolve_client_tls(data_dir=tmp_path, addrs=["127.0.0.1:7000"], env={}) == found
    assert resolve_client_tls(data_dir=tmp_path, addrs=["10.0.0.1:7000"], env={}) is None


@pytest.mark.timeout(40)
def test_scrub_over_tls(cluster: LocalCluster) -> None:
    """`tierfs scrub`: the CLI dials every node's control port (gRPC over TLS)
    and the nodes check whole chunks by fetching their peers' fragments
    (daemon to daemon, mutual TLS on the data plane)."""
    async def write() -> None:
        async with _client(cluster) as c:
            await c.mkdir("/scrub", exist_ok=True)
            await c.set_layout("/scrub", chunk_size=64 * KiB, redundancy="ec:2+1")
            await c.write_bytes("/scrub/a", os.urandom(200 * KiB))

    asyncio.run(write())
    out, err = io.StringIO(), io.StringIO()
    rc = run(["scrub", "--json", "--data", str(cluster.dir)], stdout=out, stderr=err, env={}, tty=False)
    assert rc == 0, (out.getvalue(), err.getvalue())
    total = json.loads(out.getvalue())["total"]
    assert total["unreachable"] == 0 and total["errors"] == 0, total
    assert total["chunks_verified"] >= 4, total


def _served_serial(addr: str, tls: TlsFiles) -> int:
    """Serial of the certificate the server at ``addr`` presents to a new connection."""
    from cryptography import x509

    host, _, port = addr.rpartition(":")
    ctx = ssl.create_default_context(cafile=tls.ca)
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.set_alpn_protocols(["h2"])  # gRPC ports want it; the data plane ignores it
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as s:
        der = s.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def _serial(pem: Path) -> int:
    from cryptography import x509

    return x509.load_pem_x509_certificate(pem.read_bytes()).serial_number


def _wait(cond: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f}s")
        time.sleep(0.1)


@pytest.mark.timeout(90)
def test_renewed_certificates_are_used_without_a_restart(cluster: LocalCluster, tmp_path: Path) -> None:
    """docs/security-tls.md, "Renewing certificates": new files put in place
    of a daemon's certificate and key reach its new connections (gRPC and
    data plane) within a second or two, no restart. Replaced the way a
    renewal agent does it, key first: in between the pair does not match,
    and the daemon keeps serving the old certificate rather than a broken
    pair. A client's own certificate is picked up likewise (its channels are
    made again): swapped for one no trusted CA signed, its calls are
    refused; renewed properly, they work again."""
    d = cluster.tls_dir
    client = cluster.client_tls()
    assert client is not None
    meta = next(p for p in cluster.procs if p.kind == "meta")
    storage = next(p for p in cluster.procs if p.kind == "storage")
    for p in (meta, storage):
        old = _serial(d / f"{p.name}.pem")
        assert _served_serial(p.addr, client) == old
        cert, key = issue(d, f"{p.name}-renewed", hosts=[p.addr.rpartition(":")[0]])
        new = _serial(cert)
        assert new != old
        os.replace(key, d / f"{p.name}.key")
        time.sleep(1.5)  # past the daemon's check interval: it sees the half-replaced pair
        assert _served_serial(p.addr, client) == old, f"{p.name} switched to a mismatched pair"
        os.replace(cert, d / f"{p.name}.pem")
        _wait(lambda p=p, new=new: _served_serial(p.addr, client) == new, 10,
              f"{p.name} to present its renewed certificate")
        log = (cluster.dir / "logs" / f"{p.name}.log").read_text(errors="replace")
        assert "do not load (yet)" in log, f"{p.name} did not say it refused the half-replaced pair"

    # The cluster works on: meta's heartbeats from storage, a write and a read.
    async def write_read() -> None:
        async with _client(cluster) as c:
            data = os.urandom(300 * KiB)
            await c.mkdir("/renewed", exist_ok=True)
            await c.set_layout("/renewed", chunk_size=64 * KiB, redundancy="ec:2+1")
            await c.write_bytes("/renewed/a", data)
            assert await c.read_bytes("/renewed/a") == data

    asyncio.run(write_read())

    # A client's own certificate (a copy, so the module's files stay good).
    mine = TlsFiles(ca=client.ca, cert=str(tmp_path / "me.pem"), key=str(tmp_path / "me.key"))
    for src, dst in ((client.cert, mine.cert), (client.key, mine.key)):
        Path(dst).write_bytes(Path(src).read_bytes())
        os.chmod(dst, 0o600)
    other = make_local_ca(tmp_path / "other").parent
    bad_cert, bad_key = issue(other, "intruder")
    good_cert, good_key = issue(d, "client-renewed")

    async def client_side() -> None:
        async with MetaClient(cluster.meta_addrs, deadline=1.5, attempt_timeout=0.5, tls=mine) as mc:
            await mc.get_cluster_map()

            async def works() -> bool:
                try:
                    await mc.get_cluster_map()
                    return True
                except UnavailableError:
                    return False

            async def until(want: bool, what: str) -> None:
                deadline = time.monotonic() + 15
                while await works() != want:
                    assert time.monotonic() < deadline, what
                    await asyncio.sleep(0.2)

            for src, dst in ((bad_key, mine.key), (bad_cert, mine.cert)):
                os.replace(src, dst)
            await until(False, "a client presenting a certificate of another CA was still served")
            for src, dst in ((good_key, mine.key), (good_cert, mine.cert)):
                os.replace(src, dst)
            await until(True, "the client's renewed certificate was not picked up")

    asyncio.run(client_side())


@pytest.mark.timeout(60)
def test_the_local_ca_and_certificates_survive_a_power_cut(tmp_path: Path) -> None:
    """`tierfs up --tls` makes them once: a cut right after must not take
    them (LocalCluster would then restart the daemons without TLS)."""
    from tests.faults import LazyFS

    if not LazyFS.available():
        pytest.skip("needs /dev/fuse and fusermount3")
    fs = LazyFS(tmp_path / "disk", tmp_path / "mnt")
    fs.mount()
    try:
        d = tmp_path / "mnt" / "cluster" / "tls"
        make_local_ca(d)
        issue(d, "meta-0", ["127.0.0.1"])
        made = {p.name: p.read_bytes() for p in d.iterdir()}
        assert {"ca.pem", "ca.key", "meta-0.pem", "meta-0.key"} <= set(made)
        fs.power_loss()
        fs.mount()
        assert {p.name: p.read_bytes() for p in d.iterdir()} == made
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        assert stat.S_IMODE((d / "ca.key").stat().st_mode) == 0o600
    finally:
        if fs.mounted:
            fs.unmount()


@pytest.mark.timeout(30)
def test_the_client_certificate_cannot_pose_as_a_daemon(cluster: LocalCluster, tmp_path: Path) -> None:
    """Every client is given DIR/tls/client.pem. Until stop 46 it was good
    for a server too (serverAuth, SAN 127.0.0.1): whoever held it could
    take a stopped daemon's port and be trusted by clients (and be sent
    their tokens). A TLS server presenting it is now refused by a client;
    one presenting a daemon's certificate (the control) is not."""
    from tierfs.tls import _serves

    d = cluster.tls_dir
    client = cluster.client_tls()
    assert client is not None
    assert not _serves(Path(client.cert)) and _serves(d / f"{cluster.procs[0].name}.pem")

    def handshake(cert: str, key: str) -> None:
        server_ctx = TlsFiles(ca=client.ca, cert=cert, key=key).server_ssl_context()
        client_ctx = client.client_ssl_context()
        with socket.socket() as ls:
            ls.bind(("127.0.0.1", 0))
            ls.listen(1)
            ls.settimeout(10)
            with socket.create_connection(ls.getsockname(), timeout=10) as raw:
                conn, _ = ls.accept()
                with conn:
                    import threading

                    def serve() -> None:
                        with contextlib.suppress(ssl.SSLError, OSError), \
                                server_ctx.wrap_socket(conn, server_side=True):
                            pass

                    t = threading.Thread(target=serve, daemon=True)
                    t.start()
                    try:
                        with client_ctx.wrap_socket(raw, server_hostname="127.0.0.1"):
                            pass
                    finally:
                        t.join(10)

    daemon = cluster.procs[0].name
    handshake(str(d / f"{daemon}.pem"), str(d / f"{daemon}.key"))  # the control: a daemon is trusted
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(client.cert, client.key)
    # A client certificate of before (good for a server too) is replaced
    # by the next `tierfs up`; one of now is kept.
    ca_dir = make_local_ca(tmp_path / "old").parent
    old_cert, _ = issue(ca_dir, "client")
    assert _serves(old_cert)
    new_cert, _ = issue(ca_dir, "client", client_only=True)
    assert new_cert == old_cert and not _serves(new_cert)
    kept = new_cert.read_bytes()
    issue(ca_dir, "client", client_only=True)
    assert new_cert.read_bytes() == kept
