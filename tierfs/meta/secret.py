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

__all__ = ["MIN_SECRET_CHARS", "SECRET_FILE_NAME", "ensure_secret_file", "load_secret"]

#: the file name ``tierfs up`` uses under its data directory
SECRET_FILE_NAME = "cluster.secret"
#: a shorter secret is refused: 32 hex digits are 128 bits
MIN_SECRET_CHARS = 32


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """The secret in ``path`` (surrounding white space stripped).

    ``ConfigError`` (field ``cluster_secret_file``) when the file is missing,
    unreadable, empty or too short, or when "other" users may access it."""
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
    secret = raw.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ConfigError(f"{p} holds {len(secret)} characters; a cluster secret needs at least "
                          f"{MIN_SECRET_CHARS}", field="cluster_secret_file")
    return secret


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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tierfs.meta.secret FILE``: create FILE unless it exists."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m tierfs.meta.secret FILE   (creates FILE, mode 0600, unless it exists)",
              file=sys.stderr)
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
