"""POSIX permission checks: one function decides whether an identity may
read, write or search an inode, and every namespace operation (and the
capabilities meta mints) calls it.

``want`` is a mask of :data:`R`, :data:`W`, :data:`X` (as in access(2)).
Root (uid 0, unless squashed) and admin identities pass every check;
otherwise the owner bits apply to the owner, the group bits to a member of
the inode's group, the other bits to everyone else (the first class that
matches decides, as in POSIX: an owner denied by the owner bits is denied
even if "other" would allow)."""

from __future__ import annotations

from tierfs.security import Identity

__all__ = ["R", "W", "X", "access_ok"]

R, W, X = 4, 2, 1


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
