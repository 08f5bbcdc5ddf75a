"""The cluster secret: the shared key that authenticates Raft traffic.

pysyncobj decodes every frame on the Raft port with ``pickle.loads``, so
whoever can get bytes to that decoder runs code as the meta user. Every
replica therefore holds the same secret, and :mod:`tierfs.meta.raft` accepts
only frames sealed with a key derived from it (docs/raft.md, "Authenticated
frames"). This module owns the secret's file: how it is made, and what a
file must look like to be accepted.

The file holds one line of text: at least :data:`MIN_SECRET_CHARS`
characters (``python -m tierfs.meta.secret FILE`` writes 64 hex digits of
``secrets.token_hex``). It must not be accessible to "other" users; group
access is tolerated (a Kubernetes Secret mounted with ``fsGroup`` is
group-readable).

While the secret is being rotated (docs/security.md, "Rotating the cluster
secret") the file holds up to :data:`MAX_SECRETS` lines: the first is the
*current* secret (it seals Raft frames, signs capabilities, and the admin
token and node key written for this cluster derive from it); the others are
still *accepted* (frames, tokens and capabilities made from them pass). The
``add``, ``promote`` and ``retire`` commands of ``python -m
tierfs.meta.secret`` make the three steps of a rotation.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from tierfs.errors import ConfigError
from tierfs.fsutil import fsync_dir

__all__ = ["MAX_SECRETS", "MIN_SECRET_CHARS", "SECRET_FILE_NAME", "ensure_secret_file", "load_secret",
           "load_secrets"]

#: the file name ``tierfs up`` uses under its data directory
SECRET_FILE_NAME = "cluster.secret"
#: a shorter secret is refused: 32 hex digits are 128 bits
MIN_SECRET_CHARS = 32
#: secrets one file may hold while rotating (the current one first)
MAX_SECRETS = 3


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """The current secret in ``path``: its first line (:func:`load_secrets`)."""
    return load_secrets(path)[0]


def load_secrets(path: str | os.PathLike[str]) -> list[bytes]:
    """The secrets in ``path``, one per non-empty line (surrounding white
    space stripped), the current one first.

    ``ConfigError`` (field ``cluster_secret_file``) when the file is missing,
    unreadable, empty, holds a secret too short, the same secret twice or
    more than MAX_SECRETS, or when "other" users may access it."""
    p = Path(path)
    try:
        st = p.stat()
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"cluster secret file not found: {p} (create it with "
                          f"`python -m tierfs.meta.secret {p}` and copy it to every replica)",
                          field="cluster_secret_file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read cluster secret file {p}: {exc.strerror}",
                          field="cluster_secret_file") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{p} is not a regular file", field="cluster_secret_file")
    if st.st_mode & 0o007:
        raise ConfigError(f"{p} is accessible to other users (mode {stat.S_IMODE(st.st_mode):04o}); "
                          f"chmod 0600 it", field="cluster_secret_file")
    found = [line.strip() for line in raw.splitlines() if line.strip()] or [b""]
    for i, secret in enumerate(found):
        if len(secret) < MIN_SECRET_CHARS:
            where = f"line {i + 1} of {p}" if len(found) > 1 else str(p)
            raise ConfigError(f"{where} holds {len(secret)} characters; a cluster secret needs at least "
                              f"{MIN_SECRET_CHARS}", field="cluster_secret_file")
    if len(set(found)) != len(found):
        raise ConfigError(f"{p} holds the same secret twice", field="cluster_secret_file")
    if len(found) > MAX_SECRETS:
        raise ConfigError(f"{p} holds {len(found)} secrets; at most {MAX_SECRETS} (the current one first, then "
                          f"those still accepted during a rotation)", field="cluster_secret_file")
    return found


def _rewrite(p: Path, secrets_: Sequence[bytes]) -> None:
    """Replace ``p`` with ``secrets_`` (one per line), mode 0600, durably."""
    tmp = p.with_name(p.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, b"".join(s + b"\n" for s in secrets_))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, p)
    fsync_dir(p.parent)


def add_secret(path: str | os.PathLike[str]) -> list[bytes]:
    """Rotation step 1: append a fresh random secret (accepted, not yet
    current). Returns the file's secrets."""
    p = Path(path)
    found = load_secrets(p)
    if len(found) >= MAX_SECRETS:
        raise ConfigError(f"{p} already holds {len(found)} secrets: finish the rotation under way "
                          f"(promote, then retire) first", field="cluster_secret_file")
    found.append(secrets.token_hex(32).encode())
    _rewrite(p, found)
    return found


def promote_secret(path: str | os.PathLike[str]) -> list[bytes]:
    """Rotation step 2: the newest secret (the last line) becomes the
    current one; the others stay accepted."""
    p = Path(path)
    found = load_secrets(p)
    if len(found) < 2:
        raise ConfigError(f"{p} holds one secret: add a new one first", field="cluster_secret_file")
    found = [found[-1], *found[:-1]]
    _rewrite(p, found)
    return found


def retire_secrets(path: str | os.PathLike[str]) -> list[bytes]:
    """Rotation step 3: keep only the current secret."""
    p = Path(path)
    found = load_secrets(p)[:1]
    _rewrite(p, found)
    return found


def ensure_secret_file(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` with a fresh random secret (mode 0600, durable) unless
    it exists; an existing file is validated (:func:`load_secret`) and kept.
    Returns the path."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        load_secret(p)
        return p
    try:
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(p.parent)
    return p


_USAGE = """usage: python -m tierfs.meta.secret FILE           create FILE (mode 0600) unless it exists
       python -m tierfs.meta.secret add FILE       rotation step 1: add a new secret, accepted
       python -m tierfs.meta.secret promote FILE   rotation step 2: the new secret becomes the current one
       python -m tierfs.meta.secret retire FILE    rotation step 3: drop all but the current secret
Between the steps, restart every meta replica (one at a time) with the new file
(docs/security.md, "Rotating the cluster secret")."""


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tierfs.meta.secret [add|promote|retire] FILE``."""
    args = list(sys.argv[1:] if argv is None else argv)
    steps = {"add": add_secret, "promote": promote_secret, "retire": retire_secrets}
    if len(args) == 2 and args[0] in steps and not args[1].startswith("-"):
        try:
            found = steps[args[0]](args[1])
        except (ConfigError, OSError) as exc:
            print(f"tierfs.meta.secret: {exc}", file=sys.stderr)
            return 1
        print(f"{args[1]}: {len(found)} secret(s); the current one first. Now restart every meta replica, "
              f"one at a time, with this file.")
        return 0
    if len(args) != 1 or args[0].startswith("-") or args[0] in steps:
        print(_USAGE, file=sys.stderr)
        return 2
    try:
        p = ensure_secret_file(args[0])
    except (ConfigError, OSError) as exc:
        print(f"tierfs.meta.secret: {exc}", file=sys.stderr)
        return 1
    print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
