"""POSIX permission checks: one function decides whether an identity may
read, write or search an inode, and every namespace operation (and the
capabilities meta mints) calls it.

``want`` is a mask of :data:`R`, :data:`W`, :data:`X` (as in access(2)).
Root (uid 0, unless squashed) and admin identities pass every check;
otherwise the owner bits apply to the owner, the group bits to a member of
the inode's group, the other bits to everyone else (the first class that
matches decides, as in POSIX: an owner denied by the owner bits is denied
even if "other" would allow).

The rest of the module are the POSIX rules built on that check, as pure
functions of an identity and an inode's ``mode``/``uid``/``gid`` (the state
machine applies them; docs/security-authz.md lists them): the sticky bit
(:func:`may_delete`), chmod (:func:`chmod_mode`), chown and chgrp
(:func:`check_chown`, :func:`chown_mode`), the owner of a new inode
(:func:`new_owner`) and root squash (:func:`squash`). Denials are
:class:`~tierfs.errors.PermissionDeniedError` (EACCES) or, where POSIX says
EPERM (chmod/chown by a non-owner), :class:`~tierfs.errors.NotPermittedError`.

The identity of a mutation travels in the op (``MetaOp.caller``,
:func:`caller_pb` / :func:`from_caller`): absent means root, which is what
logs written before security and clusters running without it hold.
"""

from __future__ import annotations

from dataclasses import replace

from tierfs.errors import NotPermittedError, PermissionDeniedError
from tierfs.proto.v1 import meta_pb2 as pb
from tierfs.security import ROOT, Identity

__all__ = [
    "NOBODY",
    "S_ISGID",
    "S_ISUID",
    "S_ISVTX",
    "R",
    "W",
    "X",
    "access_ok",
    "caller_pb",
    "check_chown",
    "chmod_mode",
    "chown_mode",
    "denied",
    "from_caller",
    "is_root",
    "may_delete",
    "new_owner",
    "not_permitted",
    "squash",
    "who",
]

R, W, X = 4, 2, 1
S_ISUID, S_ISGID, S_ISVTX = 0o4000, 0o2000, 0o1000
#: what root squash maps uid 0 (and its gid) to
NOBODY = 65534

_WANT_NAMES = {R: "read (r)", W: "write (w)", X: "search (x)", W | X: "write and search (w+x)",
               R | X: "read and search (r+x)", R | W: "read and write (r+w)", R | W | X: "r+w+x"}


def is_root(ident: Identity) -> bool:
    """Root for permissions: admin, or uid 0 (after :func:`squash`)."""
    return ident.admin or ident.uid == 0


def access_ok(ident: Identity, mode: int, uid: int, gid: int, want: int) -> bool:
    """Whether ``ident`` may access an inode of permission bits ``mode``
    owned by ``uid``:``gid`` as ``want`` asks."""
    if ident.admin or ident.uid == 0:
        return True
    if ident.uid == uid:
        bits = (mode >> 6) & 7
    elif ident.in_group(gid):
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    return bits & want == want


def squash(ident: Identity, root_squash: bool) -> Identity:
    """The identity permissions are judged by: with ``root_squash``, a
    non-admin user of uid 0 is ``nobody`` (uid and gid 65534, no
    supplementary groups). Admin identities, node keys and the anonymous
    caller of a cluster without security are never squashed."""
    if root_squash and ident.kind == "user" and ident.uid == 0 and not ident.admin:
        return replace(ident, uid=NOBODY, gid=NOBODY, groups=())
    return ident


def who(ident: Identity) -> str:
    return f"{ident.name or '?'} (uid {ident.uid}, gid {ident.gid})"


def _inode_desc(mode: int, uid: int, gid: int) -> str:
    return f"mode {mode & 0o7777:04o}, owner {uid}:{gid}"


def denied(op: str, what: str, ident: Identity, want: int, on: str, mode: int, uid: int,
           gid: int) -> PermissionDeniedError:
    """EACCES: ``ident`` lacks ``want`` on ``on`` (an inode described by
    ``mode``/``uid``/``gid``) for ``op`` on ``what``."""
    return PermissionDeniedError(
        f"permission denied: {op} {what}: {who(ident)} lacks {_WANT_NAMES.get(want, str(want))} "
        f"permission on {on} ({_inode_desc(mode, uid, gid)})")


def not_permitted(op: str, what: str, ident: Identity, why: str) -> NotPermittedError:
    """EPERM: the operation is reserved to the owner or root."""
    return NotPermittedError(f"{NotPermittedError.PREFIX}{op} {what}: {why} (caller {who(ident)})")


def may_delete(ident: Identity, dir_mode: int, dir_uid: int, entry_uid: int) -> bool:
    """The sticky-bit rule, once write and search permission on the
    directory are granted: in a directory with mode bit 01000 only the
    entry's owner, the directory's owner or root may remove or rename the
    entry."""
    if not dir_mode & S_ISVTX or is_root(ident):
        return True
    return ident.uid in (dir_uid, entry_uid)


def chmod_mode(ident: Identity, op: str, what: str, uid: int, gid: int, new_mode: int) -> int:
    """The mode a chmod of an inode owned by ``uid``:``gid`` to
    ``new_mode`` stores: only the owner or root may chmod
    (:class:`NotPermittedError` otherwise); a non-root owner who is not in
    the inode's group loses the setgid bit (POSIX, as Linux does)."""
    if is_root(ident):
        return new_mode
    if ident.uid != uid:
        raise not_permitted(op, what, ident, f"only the owner (uid {uid}) or root may change the mode")
    if new_mode & S_ISGID and not ident.in_group(gid):
        return new_mode & ~S_ISGID
    return new_mode


def check_chown(ident: Identity, op: str, what: str, uid: int, gid: int, new_uid: int | None,
                new_gid: int | None) -> None:
    """chown/chgrp rules: only root changes the owner (an owner "changing"
    it to itself is a no-op that passes); the owner may change the group to
    one of its own groups. :class:`NotPermittedError` otherwise."""
    if is_root(ident):
        return
    if new_uid is not None and new_uid != uid:
        raise not_permitted(op, what, ident, f"only root may change the owner (from {uid} to {new_uid})")
    if new_gid is not None and new_gid != gid:
        if ident.uid != uid:
            raise not_permitted(op, what, ident, f"only the owner (uid {uid}) or root may change the group")
        if not ident.in_group(new_gid):
            raise not_permitted(op, what, ident, f"the owner may only change the group to one of its own "
                                                 f"groups, and is not in group {new_gid}")
    if (new_uid is not None or new_gid is not None) and ident.uid != uid:
        # chown(f, own uid, same gid) by someone else: POSIX refuses it too.
        raise not_permitted(op, what, ident, f"only the owner (uid {uid}) or root may chown")


def chown_mode(mode: int, is_dir: bool) -> int:
    """What a chown or chgrp of a non-directory leaves of ``mode``: setuid
    is cleared, and setgid where group execute is set (setgid without group
    execute is mandatory locking, not a privilege); as Linux does, also
    for root. Directories keep their bits."""
    if is_dir:
        return mode
    mode &= ~S_ISUID
    if mode & (S_ISGID | 0o010) == S_ISGID | 0o010:
        mode &= ~S_ISGID
    return mode


def new_owner(ident: Identity, req_uid: int, req_gid: int, mode: int, is_dir: bool, parent_mode: int,
              parent_gid: int) -> tuple[int, int, int]:
    """``(uid, gid, mode)`` of an inode ``ident`` creates with the request's
    ``req_uid``/``req_gid``/``mode`` in a directory of ``parent_mode`` and
    ``parent_gid``.

    The owner is the caller; only root and admin callers may set another
    owner or group through the request (a non-zero field is used as given,
    zero means the caller's own, so a root caller gets what it asked for as
    before). In a setgid directory the group is the directory's, and a new
    directory inherits the setgid bit. A non-root creator outside the new
    inode's group cannot set setgid on a file (cleared, as Linux does)."""
    if is_root(ident):
        uid = req_uid or ident.uid
        gid = req_gid or ident.gid
    else:
        uid, gid = ident.uid, ident.gid
    if parent_mode & S_ISGID:
        gid = parent_gid
        if is_dir:
            mode |= S_ISGID
    if not is_dir and mode & S_ISGID and not is_root(ident) and not ident.in_group(gid):
        mode &= ~S_ISGID
    return uid, gid, mode


def from_caller(op: pb.MetaOp) -> Identity:
    """The identity an op runs as (its ``caller``; root when absent)."""
    if not op.HasField("caller"):
        return ROOT
    c = op.caller
    return Identity(c.name, c.uid, c.gid, tuple(c.groups), c.admin, c.kind or "user")


def caller_pb(ident: Identity) -> pb.Caller:
    return pb.Caller(name=ident.name, uid=ident.uid, gid=ident.gid, groups=list(ident.groups),
                     admin=ident.admin, kind=ident.kind)
