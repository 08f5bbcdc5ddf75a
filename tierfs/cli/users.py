"""``tierfs user ...`` and ``tierfs whoami``: users and their tokens
(admin only; docs/security.md). A token is printed once, when it is made;
meta keeps only its hash."""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from tierfs.proto.v1 import meta_pb2 as pb

__all__ = ["add_commands", "execute", "parse_expires"]

_EXPIRES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")
_UNITS = {None: 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_expires(value: str) -> float:
    """``"30d"`` -> seconds (units s, m, h, d; ``0`` = never); argparse type."""
    m = _EXPIRES_RE.match(value)
    if not m:
        why = "a lifetime is not negative; " if value.strip().startswith("-") else ""
        raise argparse.ArgumentTypeError(f"not a lifetime: {value!r} ({why}examples: 3600, 90m, 12h, 30d; "
                                         f"0 = never)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _id(value: str) -> int:
    """A uid or gid: 0 to 2**32 - 2 (2**32 - 1 is (uid_t)-1, "no id", in
    POSIX; ``chown -1`` leaves an owner unchanged)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0 <= n < 2**32 - 1:
        raise argparse.ArgumentTypeError(f"ids are numbers from 0 to {2**32 - 2}: {value!r}")
    return n


def _groups(value: str) -> list[int]:
    """``1,2,3`` (empty: none). An empty item (``1,,2``) is refused: a typo
    there may have dropped a gid the user was meant to have."""
    if not value.strip():
        return []
    try:
        out = [int(g) for g in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of gids: {value!r}") from None
    if any(not 0 <= g < 2**32 - 1 for g in out):
        raise argparse.ArgumentTypeError(f"gids are numbers from 0 to {2**32 - 2}: {value!r}")
    return out


def add_commands(cmd: Callable[..., argparse.ArgumentParser]) -> None:
    p = cmd("user", "users and tokens (admin): add, ls, rm, token (issue another), revoke")
    p.add_argument("action", choices=["add", "ls", "rm", "token", "revoke"])
    p.add_argument("name", nargs="?", default="")
    p.add_argument("--uid", type=_id, help="add: the user's uid (a non-admin uid 0 is judged as nobody under root_squash)")
    p.add_argument("--gid", type=_id, help="add: the user's primary gid")
    p.add_argument("--groups", type=_groups, default=[], metavar="GID,...", help="add: supplementary gids")
    p.add_argument("--admin", action="store_true", help="add: an admin (admin operations, root for permissions)")
    p.add_argument("--expires", type=parse_expires, default=0.0, metavar="TIME",
                   help="add/token: the token's lifetime (e.g. 30d, 12h; default: never)")
    p.add_argument("--id", dest="token_id", type=int, default=0, help="revoke: the token id (`tierfs user ls`)")
    p.add_argument("--all", dest="all_tokens", action="store_true", help="revoke: every token of the user")
    cmd("whoami", "who meta takes this command's credential for")


def _when(ns: int) -> str:
    if not ns:
        return "never"
    return datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _token_state(t: dict[str, Any], now: int) -> str:
    if t["revoked"]:
        return "revoked"
    return "expired" if t["expires_ns"] and t["expires_ns"] <= now else "live"


def _token_cell(t: dict[str, Any], now: int) -> str:
    st = _token_state(t, now)
    return f"{t['id']}:{_when(t['expires_ns']) if st == 'live' else st}"


def _user(u: pb.User) -> dict[str, Any]:
    return {"name": u.name, "uid": u.uid, "gid": u.gid, "groups": list(u.groups), "admin": u.admin,
            "created_ns": u.created_ns,
            "tokens": [{"id": t.id, "created_ns": t.created_ns, "expires_ns": t.expires_ns, "revoked": t.revoked}
                       for t in u.tokens]}


async def _run(ns: argparse.Namespace, meta: Sequence[str]) -> dict[str, Any]:
    from tierfs.meta import MetaClient

    async with MetaClient(list(meta), deadline=ns.timeout) as mc:
        if ns.cmd == "whoami":
            c = await mc.whoami()
            return {"name": c.name, "uid": c.uid, "gid": c.gid, "groups": list(c.groups), "admin": c.admin,
                    "kind": c.kind}
        a = ns.action
        if a == "ls":
            return {"users": [_user(u) for u in await mc.list_users()]}
        if a == "add":
            r = await mc.add_user(ns.name, ns.uid, ns.gid, ns.groups, admin=ns.admin, expires=ns.expires)
        elif a == "token":
            r = await mc.issue_token(ns.name, expires=ns.expires)
        elif a == "rm":
            await mc.remove_user(ns.name)
            return {"name": ns.name, "removed": True}
        else:
            n = await mc.revoke_token(ns.name, ns.token_id, all=ns.all_tokens)
            return {"name": ns.name, "revoked": n}
        return {"user": _user(r.user), "token_id": r.token_id, "token": r.token}


def execute(ns: argparse.Namespace, meta: Sequence[str], emit: Callable[[Any, str | None], None],
            run: Callable[[Any], Any], err: TextIO | None = None) -> int | None:
    """Run ``ns`` if it is one of this module's commands; its exit code (None: not ours)."""
    from tierfs.cli.main import _UsageError
    from tierfs.cli.util import table

    if ns.cmd == "whoami":
        r = run(_run(ns, meta))
        emit(r, f"{r['name']} ({r['kind']}{', admin' if r['admin'] and r['kind'] != 'admin' else ''}): "
                f"uid {r['uid']} gid {r['gid']}"
                + (f" groups {','.join(map(str, r['groups']))}" if r["groups"] else ""))
        return 0
    if ns.cmd != "user":
        return None
    if ns.action != "ls" and not ns.name:
        raise _UsageError(f"tierfs user {ns.action}: give the user's NAME")
    if ns.action == "add" and (ns.uid is None or ns.gid is None):
        raise _UsageError("tierfs user add: give --uid N and --gid N")
    if ns.action == "revoke" and not (ns.token_id or ns.all_tokens):
        raise _UsageError("tierfs user revoke: give --id N or --all")
    r = run(_run(ns, meta))
    if ns.action == "ls":
        rows = []
        now = time.time_ns()
        for u in r["users"]:
            live = [t for t in u["tokens"] if _token_state(t, now) == "live"]
            rows.append([u["name"], u["uid"], u["gid"], ",".join(map(str, u["groups"])) or "-",
                         "yes" if u["admin"] else "", f"{len(live)}/{len(u['tokens'])}",
                         ", ".join(_token_cell(t, now) for t in u["tokens"]) or "-"])
        emit(r, table(rows, ["USER", "UID", "GID", "GROUPS", "ADMIN", "TOKENS (live/all)",
                             "TOKENS (id:expiry, or revoked/expired)"])
             if rows else "no users")
    elif ns.action in ("add", "token"):
        t = next(x for x in r["user"]["tokens"] if x["id"] == r["token_id"])
        # The token alone on stdout (`tierfs user token alice > alice.token`,
        # `TIERFS_TOKEN=$(tierfs user token alice)`); the note on stderr.
        emit(r, r["token"])
        if not ns.json:
            print(f"# token {r['token_id']} of user {ns.name} (expires {_when(t['expires_ns'])}): shown once, "
                  "keep it in a 0600 file and pass it as TIERFS_TOKEN or --token-file", file=err or sys.stderr)
    elif ns.action == "rm":
        emit(r, f"user {ns.name} removed (its tokens no longer work)")
    else:
        emit(r, f"revoked {r['revoked']} token(s) of user {ns.name}")
    return 0
