"""TLS for TierFS's TCP ports: the meta and storage-control gRPC servers and
the TCP data plane (docs/security-tls.md).

:class:`TlsFiles` names an endpoint's PEM files (the CA it trusts, its own
certificate and key) and turns them into what each stack wants: gRPC server
and channel credentials, and :class:`ssl.SSLContext` objects for the asyncio
data plane. :func:`resolve_client_tls` is the one place a client decides
whether to use TLS (explicit files > ``TIERFS_TLS_CA``/``_CERT``/``_KEY`` >
a local cluster's ``DIR/tls/``). :func:`make_local_ca` and :func:`issue` are
the throwaway CA of ``tierfs up --tls``.

Renewed files are picked up without a restart (docs/security-tls.md,
"Renewing certificates"): gRPC servers get dynamic credentials that look at
the files' stat on each new handshake; the data plane's SSL contexts are
reloaded in place (:func:`refresh_ssl_context`: a listener checks every
second, a dialler before each new connection); gRPC channels are made again
once the files changed (:class:`TlsStamp`). A changed set that does not load
(a key that does not match the certificate: the pair is half replaced) is
not used; the files loaded before stay in use until it does.

The policy, everywhere: a server with a certificate serves TLS only (no
plaintext on the same port). Clients verify the server against the CA
(hostname or IP in the certificate's SAN). With ``tls_require_client_cert``
a server also requires a client certificate signed by its CA from every
client: mutual TLS. Daemons always present their own certificate when they
dial (storage -> meta, repair and rebuild between storage nodes), so with
the requirement on, daemon-to-daemon traffic is mutual TLS; without it, only
the server is authenticated by TLS and clients by their token. ``tierfs up
--tls`` turns the requirement on and gives its clients a certificate.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import ipaddress
import logging
import os
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from tierfs.errors import ConfigError
from tierfs.fsutil import makedirs_durable, write_durable

log = logging.getLogger(__name__)

__all__ = [
    "CA_FILE",
    "CLIENT_NAME",
    "TLS_DIR",
    "TlsFiles",
    "channel_credentials",
    "default_data_dir",
    "grpc_channel",
    "issue",
    "make_local_ca",
    "refresh_ssl_context",
    "resolve_client_tls",
    "unreachable_hint",
]

#: Subdirectory of a local cluster's data dir holding its CA and certificates.
TLS_DIR = "tls"
CA_FILE = "ca.pem"
#: The certificate ``tierfs up --tls`` makes for the cluster's clients.
CLIENT_NAME = "client"

#: A daemon looks at its TLS files (one stat each) at most this often for
#: renewed ones: a data-plane listener on a timer, a dialler before a new
#: connection, a gRPC client before a call (gRPC servers: every handshake).
RELOAD_CHECK_INTERVAL = 1.0

#: The data dir a client looks in for a local cluster's files when none is
#: named (the CLI's ``--data`` sets it for one command; tierfs.cli.util.DEFAULT_DATA).
default_data_dir: contextvars.ContextVar[str] = contextvars.ContextVar("tierfs_data_dir", default="./.tierfs")


def _read(path: str, what: str, field: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}", field=field) from None


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """PEM files of one endpoint. ``ca``: the certificates it trusts (a
    client verifies servers with it; a server verifies client certificates
    with it). ``cert``/``key``: its own identity (a server's is required; a
    client's is presented when set). ``require_client_cert``: a server
    refuses clients without a certificate signed by ``ca``."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    require_client_cert: bool = False

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("tls_cert and tls_key go together", field="tls_cert" if not self.cert else "tls_key")
        if self.require_client_cert and not self.ca:
            raise ConfigError("requiring client certificates needs tls_ca (to verify them)",
                              field="tls_require_client_cert")

    @classmethod
    def from_config(cls, cfg: Any, *, load: bool = True) -> TlsFiles | None:
        """From a config with ``tls_ca``, ``tls_cert``, ``tls_key`` and
        ``tls_require_client_cert`` fields; None when TLS is off (no cert).
        ``load``: also read the files (a config's ``validate`` checks only
        that the fields fit together)."""
        if not (cfg.tls_cert or cfg.tls_key or cfg.tls_ca):
            if cfg.tls_require_client_cert:
                raise ConfigError("needs tls_cert, tls_key and tls_ca", field="tls_require_client_cert")
            return None
        if not cfg.tls_cert:
            raise ConfigError("a TLS server needs tls_cert and tls_key (tls_ca alone is not enough)",
                              field="tls_cert")
        files = cls(ca=cfg.tls_ca, cert=cfg.tls_cert, key=cfg.tls_key,
                    require_client_cert=cfg.tls_require_client_cert)
        if load:
            files.server_ssl_context()  # unreadable or mismatched files fail at start, not at the first client
        return files

    def _cert_pair(self) -> tuple[bytes, bytes]:
        return _read(self.key, "key", "tls_key"), _read(self.cert, "certificate", "tls_cert")

    def stamp(self) -> tuple[tuple[int, int, int] | None, ...]:
        """What changes when any of the files is replaced or rewritten:
        (mtime, size, inode) of each (None: not set, or missing)."""
        out: list[tuple[int, int, int] | None] = []
        for path in (self.ca, self.cert, self.key):
            try:
                st = os.stat(path) if path else None
            except OSError:
                st = None
            out.append((st.st_mtime_ns, st.st_size, st.st_ino) if st is not None else None)
        return tuple(out)

    def describe(self) -> str:
        """The certificate in one line, for logs: subject, serial, expiry."""
        try:
            from cryptography import x509

            c = x509.load_pem_x509_certificate(Path(self.cert).read_bytes())
            return (f"{self.cert} ({c.subject.rfc4514_string()}, serial {c.serial_number:x}, "
                    f"valid until {c.not_valid_after_utc:%Y-%m-%d %H:%M} UTC)")
        except Exception as exc:  # a log line must not fail
            return f"{self.cert} (unreadable: {exc})"

    # --- gRPC ------------------------------------------------------------

    def _grpc_server_config(self) -> Any:
        # gRPC's Python API has no "verify if presented": without the
        # requirement a client certificate is not asked for at all.
        return grpc.ssl_server_certificate_configuration(
            [self._cert_pair()],
            root_certificates=_read(self.ca, "CA", "tls_ca") if self.require_client_cert else None)

    def grpc_server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials that pick up renewed files: gRPC asks
        ``fetch`` on every new handshake, which answers a new configuration
        only when the files' stamp changed and the new set loads (a
        mismatched key and certificate is refused: the ones loaded before
        stay in use, and the set is tried again when it changes again)."""
        lock = threading.Lock()
        state: dict[str, Any] = {"stamp": self.stamp(), "refused": None}
        initial = self._grpc_server_config()

        def fetch() -> Any:
            try:
                stamp = self.stamp()
                with lock:
                    if stamp in (state["stamp"], state["refused"]):
                        return None
                    try:
                        self._server_context()  # the key matches the certificate, the CA parses
                        config = self._grpc_server_config()
                    except ConfigError as exc:
                        state["refused"] = stamp
                        log.warning("TLS files changed but do not load (yet): %s; the gRPC server keeps the "
                                    "certificate it had", exc)
                        return None
                    state["stamp"], state["refused"] = stamp, None
                log.info("TLS: the gRPC server now presents %s", self.describe())
                return config
            except Exception:  # called from gRPC's core: never raise into it
                log.exception("TLS: checking for renewed files failed")
                return None

        return grpc.dynamic_ssl_server_credentials(initial, fetch,
                                                   require_client_authentication=self.require_client_cert)

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        key, cert = self._cert_pair() if self.cert else (None, None)
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "CA", "tls_ca"),
                                            private_key=key, certificate_chain=cert)

    # --- the data plane (asyncio / uvloop) ----------------------------------

    def server_ssl_context(self) -> ssl.SSLContext:
        """A server context, reloaded in place by :func:`refresh_ssl_context`."""
        return _watch(self._server_context(), self, server=True)

    def client_ssl_context(self) -> ssl.SSLContext:
        """A client context, reloaded in place by :func:`refresh_ssl_context`."""
        return _watch(self._client_context(), self, server=False)

    def _server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)
            if self.ca:
                ctx.load_verify_locations(self.ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"bad TLS files (cert {self.cert}, key {self.key}, ca {self.ca or '-'}): {exc}",
                              field="tls_cert") from None
        if self.ca:
            ctx.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_OPTIONAL
        return ctx

    def _client_context(self) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            if self.cert:
                ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"bad TLS files (ca {self.ca}, cert {self.cert or '-'}): {exc}",
                              field="tls_ca") from None
        return ctx

    def client_side(self) -> TlsFiles:
        """The same files used as a client (a daemon dialling a peer):
        its CA to verify the peer, its certificate to present."""
        return TlsFiles(ca=self.ca, cert=self.cert, key=self.key)


class _Watch:
    """What a context was made from, and what was last loaded into it."""

    __slots__ = ("checked", "files", "refused", "server", "stamp")

    def __init__(self, files: TlsFiles, server: bool) -> None:
        self.files, self.server = files, server
        self.stamp = files.stamp()
        self.refused: tuple[Any, ...] | None = None
        self.checked = time.monotonic()


_watched: weakref.WeakKeyDictionary[ssl.SSLContext, _Watch] = weakref.WeakKeyDictionary()
_watch_lock = threading.Lock()


def _watch(ctx: ssl.SSLContext, files: TlsFiles, *, server: bool) -> ssl.SSLContext:
    with _watch_lock:
        _watched[ctx] = _Watch(files, server)
    return ctx


def refresh_ssl_context(ctx: ssl.SSLContext | None, *, min_interval: float = RELOAD_CHECK_INTERVAL) -> bool:
    """Load renewed files into ``ctx`` (one made by ``server_ssl_context`` or
    ``client_ssl_context``) if they changed since it was made or last
    reloaded; connections made after use them, open ones keep theirs.
    Looks (one stat per file) at most every ``min_interval`` seconds. A
    changed set that does not load is refused once, logged, and ``ctx`` keeps
    what it had. A CA file's new certificates are added to what the context
    trusts; one dropped from it stays trusted until a restart. True when it
    reloaded."""
    if ctx is None:
        return False
    with _watch_lock:
        w = _watched.get(ctx)
        now = time.monotonic()
        if w is None or now - w.checked < min_interval:
            return False
        w.checked = now
        stamp = w.files.stamp()
        if stamp in (w.stamp, w.refused):
            return False
        files = w.files
        try:
            # Load a fresh context first: a half-replaced pair must not reach
            # ``ctx`` (load_cert_chain would leave it with the new certificate
            # and the old key).
            files._server_context() if w.server else files._client_context()
            if files.cert:
                ctx.load_cert_chain(files.cert, files.key)
            if files.ca:
                ctx.load_verify_locations(files.ca)
        except (ConfigError, OSError, ssl.SSLError) as exc:
            w.refused = stamp
            log.warning("TLS files changed but do not load (yet): %s; keeping the certificate loaded before", exc)
            return False
        w.stamp, w.refused = stamp, None
    log.info("TLS: reloaded %s for new %s connections", files.describe() if files.cert else files.ca,
             "incoming" if w.server else "outgoing")
    return True


class TlsStamp:
    """For a gRPC client: whether its TLS files changed since the channels
    were made (so they must be made again: gRPC channel credentials are
    fixed). Looks at most every RELOAD_CHECK_INTERVAL seconds."""

    def __init__(self, tls: TlsFiles | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.tls = tls
        self._clock = clock
        self._stamp = tls.stamp() if tls is not None else ()
        self._refused: tuple[Any, ...] | None = None
        self._checked = clock()

    def changed(self) -> bool:
        if self.tls is None:
            return False
        now = self._clock()
        if now - self._checked < RELOAD_CHECK_INTERVAL:
            return False
        self._checked = now
        stamp = self.tls.stamp()
        if stamp in (self._stamp, self._refused):
            return False
        try:
            self.tls._client_context()  # loads: not a half-replaced pair
        except ConfigError as exc:
            self._refused = stamp
            log.warning("TLS files changed but do not load (yet): %s; keeping the channels made before", exc)
            return False
        self._stamp = stamp
        log.info("TLS: files changed (%s); new gRPC channels use them", self.tls.describe() if self.tls.cert
                 else self.tls.ca)
        return True


def _local_addrs(data_dir: Path) -> set[str]:
    """Addresses a local cluster's cluster.toml names (meta and storage)."""
    import tomllib

    try:
        doc = tomllib.loads((data_dir / "cluster.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return set()
    meta = doc.get("cluster", {}).get("meta", [])
    procs = [p.get("addr", "") for p in doc.get("process", []) if isinstance(p, dict)]
    return {str(a) for a in [*meta, *procs] if a}


def resolve_client_tls(ca: str | None = None, cert: str | None = None, key: str | None = None, *,
                       data_dir: str | os.PathLike[str] | None = None, addrs: Sequence[str] | None = None,
                       env: Mapping[str, str] | None = None) -> TlsFiles | None:
    """The TLS files a client uses, or None for plaintext. The first of:
    ``ca`` given (``""`` means plaintext, never replaced by a default),
    ``TIERFS_TLS_CA``, ``DATA/tls/ca.pem`` of a local cluster (``data_dir``,
    default :data:`default_data_dir`) when that file exists and, if
    ``addrs`` (the addresses about to be dialled) is given, the cluster's
    cluster.toml names one of them: a TLS cluster in ./.tierfs must not
    turn TLS on for a client of another cluster. The client certificate
    likewise: ``cert``/``key``, ``TIERFS_TLS_CERT``/``_KEY``,
    ``DATA/tls/client.pem``/``.key`` next to a local CA."""
    env = os.environ if env is None else env
    local = Path(data_dir if data_dir is not None else default_data_dir.get()) / TLS_DIR
    if ca is None:
        ca = env.get("TIERFS_TLS_CA")
        if (ca is None and (local / CA_FILE).is_file()
                and (addrs is None or not _local_addrs(local.parent).isdisjoint(addrs))):
            ca = str(local / CA_FILE)
            if cert is None and "TIERFS_TLS_CERT" not in env and (local / f"{CLIENT_NAME}.pem").is_file():
                cert, key = str(local / f"{CLIENT_NAME}.pem"), str(local / f"{CLIENT_NAME}.key")
    if not ca:
        return None
    if cert is None:
        cert, key = env.get("TIERFS_TLS_CERT", ""), env.get("TIERFS_TLS_KEY", "")
    return TlsFiles(ca=ca, cert=cert or "", key=key or "")


def unreachable_hint(last_error: str, tls: TlsFiles | None) -> str:
    """What to add to "cluster unreachable" when the last error looks like
    a TLS mismatch (gRPC says only "Socket closed" when the server drops a
    plaintext client or one without a certificate)."""
    if "handshake failed" in last_error.lower() or "CERTIFICATE_VERIFY_FAILED" in last_error:
        ca = tls.ca if tls is not None else "-"
        return (f"; TLS handshake failed: the client's CA ({ca}) did not sign the server's certificate, or the "
                "address dialled is not in it")
    if "Socket closed" not in last_error:
        return ""
    if tls is None:
        return ("; the server closed the connection at once: if the cluster serves TLS, give the client its CA "
                "(TIERFS_TLS_CA, ClientConfig.tls_ca; `tierfs --data DIR` for a `tierfs up --tls` cluster)")
    if not tls.cert:
        return ("; the server closed the connection at once: if the cluster requires client certificates, "
                "give the client one (TIERFS_TLS_CERT, TIERFS_TLS_KEY)")
    # A certificate the server did not accept: gRPC says only "Socket closed".
    if not _authenticates_clients(Path(tls.cert)):
        return (f"; the server closed the connection at once: if the cluster requires client certificates, it did "
                f"not accept the client's ({tls.cert}): its extended key usage lacks clientAuth (a daemon's "
                "certificate needs serverAuth and clientAuth: it presents it when it dials meta and other daemons)")
    return (f"; the server closed the connection at once: if the cluster requires client certificates, it did "
            f"not accept the client's ({tls.cert}): signed by a CA the cluster does not trust, or expired")


def channel_credentials(tls: TlsFiles | None) -> grpc.ChannelCredentials | None:
    """gRPC channel credentials of ``tls`` (None: plaintext). Call
    credentials (the bearer token) compose with these through
    ``grpc.composite_channel_credentials``."""
    return tls.grpc_channel_credentials() if tls is not None else None


#: Reconnect backoff of every control-plane channel. gRPC's defaults (1 s,
#: x1.6, up to 120 s) leave a channel that failed while meta was down for
#: 10 s unused for up to ~6 s after meta is back, and for minutes after a
#: long outage: storage daemons then missed the new leader's heartbeat
#: timeout and were all marked offline at once (file groups degraded, KV
#: groups re-planned). A failed connect to one of a few meta replicas costs
#: little, so retry at most every second; the connect deadline stays at
#: least 5 s (``min_reconnect_backoff_ms`` is that floor in gRPC core), for
#: TLS handshakes over a slow link.
RECONNECT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 5000),
)


def grpc_channel(addr: str, tls: TlsFiles | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An aio channel to ``addr``: TLS with ``tls``, plaintext without;
    :data:`RECONNECT_OPTIONS` unless ``options`` sets them."""
    given = {k for k, _ in options}
    opts = [*options, *(o for o in RECONNECT_OPTIONS if o[0] not in given)]
    creds = channel_credentials(tls)
    if creds is None:
        return grpc.aio.insecure_channel(addr, options=opts)
    return grpc.aio.secure_channel(addr, creds, options=opts)


# --- the local CA of `tierfs up --tls` ----------------------------------------------

def _write_private(path: Path, data: bytes) -> None:
    # Durably: a power cut right after `tierfs up --tls` must not leave a
    # cluster whose certificates are gone (it would restart without TLS).
    write_durable(path, data, 0o600)


def _write_public(path: Path, data: bytes) -> None:
    write_durable(path, data, 0o644)


def make_local_ca(tls_dir: str | os.PathLike[str], *, days: int = 3650) -> Path:
    """Make ``tls_dir/ca.pem`` and ``ca.key`` (0600) unless they exist;
    returns the CA certificate's path. The CA signs the certificates of one
    local cluster and nothing else (docs/security-tls.md)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    d = makedirs_durable(tls_dir, 0o700)
    os.chmod(d, 0o700)
    ca_pem, ca_key = d / CA_FILE, d / "ca.key"
    if ca_pem.exists() and ca_key.exists():
        return ca_pem
    key = ec.generate_private_key(ec.SECP256R1())
    # CNs are capped at 64 characters: a random tag tells two local CAs apart, not a path.
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"TierFS local CA {os.urandom(4).hex()}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(ca_key, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()))
    _write_public(ca_pem, cert.public_bytes(serialization.Encoding.PEM))
    return ca_pem


def _authenticates_clients(cert_path: Path) -> bool:
    """Whether the certificate at ``cert_path`` may be presented by a TLS
    client (no extended key usage, or one with clientAuth; an unreadable
    file counts as yes: nothing to say about it)."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return True
    return ExtendedKeyUsageOID.CLIENT_AUTH in eku


def _serves(cert_path: Path) -> bool:
    """Whether the certificate at ``cert_path`` is good for a server."""
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except (ValueError, x509.ExtensionNotFound):
        return True  # unreadable, or no EKU (good for anything): not what client_only wants
    return ExtendedKeyUsageOID.SERVER_AUTH in eku


def issue(tls_dir: str | os.PathLike[str], name: str, hosts: Sequence[str] = (), *,
          days: int = 825, client_only: bool = False) -> tuple[Path, Path]:
    """Sign ``tls_dir/<name>.pem`` and ``<name>.key`` (0600) with the local
    CA, unless they exist. SAN: ``hosts`` plus 127.0.0.1, ::1 and localhost;
    usable both as a server and as a client certificate (a daemon is both).
    ``client_only``: a client certificate, no more (client authentication
    only, no addresses): whoever holds it cannot pose as a daemon to
    clients. An existing one that is good for a server too (made before
    stop 46) is replaced. Returns (cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = Path(tls_dir)
    cert_path, key_path = d / f"{name}.pem", d / f"{name}.key"
    if cert_path.exists() and key_path.exists() and not (client_only and _serves(cert_path)):
        return cert_path, key_path
    ca_cert = x509.load_pem_x509_certificate((d / CA_FILE).read_bytes())
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{d / 'ca.key'} is not the EC key of a TierFS local CA", field="tls")
    sans: list[x509.GeneralName] = []
    for h in dict.fromkeys([] if client_only else [*hosts, "127.0.0.1", "::1", "localhost"]):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client_only else [ExtendedKeyUsageOID.SERVER_AUTH,
                                                                      ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    _write_private(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path
