"""``tierfs meta-replica add|rm RAFT=GRPC``: change the meta Raft group's
membership (admin; docs/operations.md, "Replacing a meta replica").

Until stop 47 the only way was ``MetaClient.add_member``/``remove_member``
from Python (a new operator had to find them)."""

from __future__ import annotations

import argparse
import asyncio
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
    p.add_argument("--force", action="store_true",
                   help="add: a replica that does not answer yet; rm: even where the members left would not "
                        "have a majority that answers (metadata stops until enough come back)")


async def _answers(grpc: str, timeout: float) -> bool:
    """Whether a meta replica answers GetStatus at ``grpc``."""
    from tierfs.errors import TierFSError
    from tierfs.meta import MetaClient

    try:
        async with MetaClient([grpc], deadline=timeout, attempt_timeout=min(timeout, 2.0)) as mc:
            await mc.status(addr=grpc)
    except TierFSError:
        return False
    return True


async def _run(ns: argparse.Namespace, meta: Sequence[str]) -> dict[str, Any]:
    from tierfs.errors import BusyError, InvalidArgumentError, UnavailableError
    from tierfs.meta import MetaClient

    raft, grpc = ns.member
    async with MetaClient(list(meta), deadline=max(ns.timeout, 30.0)) as mc:
        if ns.action == "add":
            if not ns.force and not await _answers(grpc, min(ns.timeout, 5.0)):
                # A member that is not there counts against the majority at
                # once (it was added without a word until stop 47).
                raise UnavailableError(f"no meta replica answers at {grpc}: start it first (with --peer for each "
                                       f"current member), or add it anyway with --force")
            await mc.add_member(raft, grpc)
        else:
            lead = await mc.status()
            known = dict(lead.raft.addr_map).get(raft) if lead.HasField("raft") else None
            if known and known != grpc:
                # The operator is told to stop the replica at grpc next: a
                # mismatch would stop the wrong one.
                raise InvalidArgumentError(f"the member at raft {raft} serves gRPC on {known}, not {grpc}: give "
                                           f"its own pair ({raft}={known})")
            left = [m for m in lead.members if m != grpc]
            up = sum(await asyncio.gather(*(_answers(m, min(ns.timeout, 5.0)) for m in left)))
            need = len(left) // 2 + 1
            if up < need and not ns.force:
                raise BusyError(f"removing {raft} leaves {len(left)} member(s) of which {up} answer: a leader needs "
                                f"{need}, so metadata would stop. Start the ones that are down first, or remove it "
                                f"anyway with --force")
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
