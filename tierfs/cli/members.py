"""``tierfs meta-replica add|rm RAFT=GRPC``: change the meta Raft group's
membership (admin; docs/operations.md, "Replacing a meta replica").

Until stop 47 the only way was ``MetaClient.add_member``/``remove_member``
from Python (a new operator had to find them)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["add_commands", "execute"]


def _member(value: str) -> tuple[str, str]:
    raft, sep, grpc = value.partition("=")
    if not sep or not raft or not grpc or ":" not in raft or ":" not in grpc:
        raise argparse.ArgumentTypeError(f"give the replica as RAFT_HOST:PORT=GRPC_HOST:PORT (as --peer), "
                                         f"not {value!r}")
    return raft, grpc


def add_commands(cmd: Callable[..., argparse.ArgumentParser]) -> None:
    p = cmd("meta-replica", "meta Raft membership (admin): add a started replica, or rm one for good")
    p.add_argument("action", choices=["add", "rm"])
    p.add_argument("member", type=_member, metavar="RAFT=GRPC",
                   help="the replica's Raft and gRPC addresses, as its --raft-addr and --grpc-addr")


async def _run(ns: argparse.Namespace, meta: Sequence[str]) -> dict[str, Any]:
    from tierfs.meta import MetaClient

    raft, grpc = ns.member
    async with MetaClient(list(meta), deadline=max(ns.timeout, 30.0)) as mc:
        if ns.action == "add":
            await mc.add_member(raft, grpc)
        else:
            await mc.remove_member(raft, grpc)
        st = await mc.status()
    return {"action": ns.action, "raft": raft, "grpc": grpc, "members": list(st.members)}


def execute(ns: argparse.Namespace, meta: Sequence[str], emit: Callable[[Any, str | None], None],
            run: Callable[[Any], Any]) -> int | None:
    """Run ``ns`` if it is this module's command; its exit code (None: not ours)."""
    if ns.cmd != "meta-replica":
        return None
    r = run(_run(ns, meta))
    if ns.action == "add":
        text = (f"meta replica {r['raft']} (gRPC {r['grpc']}) added: it catches up from the leader. Add "
                f"{r['grpc']} to TIERFS_META / clients' meta addresses and storage daemons' meta_addrs")
    else:
        text = (f"meta replica {r['raft']} (gRPC {r['grpc']}) removed: stop its daemon, and take {r['grpc']} "
                f"out of TIERFS_META / clients' meta addresses and storage daemons' meta_addrs")
    emit(r, text + f"\nmembers now: {', '.join(r['members'])}")
    return 0
