"""Metadata service: the Raft-replicated state machine, its journal and snapshots, and its gRPC API.

The names below are loaded on first use (PEP 562): a client, the CLI or a
storage daemon that needs only :class:`MetaClient` does not pay for
importing the server and its state machine (~0.15 s of CPU per process)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "DEFAULT_LAYOUT",
    "ROOT_INODE",
    "LayoutSpec",
    "LocalReplicator",
    "MetaClient",
    "MetaServicer",
    "MetaStateMachine",
    "ReplicaStatus",
    "Replicator",
    "StateMachine",
    "Where",
    "add_meta_service",
    "format_redundancy",
    "parse_redundancy",
]

_WHERE = {
    "MetaClient": "client", "Where": "client",
    "LocalReplicator": "interfaces", "ReplicaStatus": "interfaces", "Replicator": "interfaces",
    "StateMachine": "interfaces",
    "DEFAULT_LAYOUT": "ops", "LayoutSpec": "ops", "format_redundancy": "ops", "parse_redundancy": "ops",
    "MetaServicer": "service", "add_meta_service": "service",
    "ROOT_INODE": "state", "MetaStateMachine": "state",
}

if TYPE_CHECKING:
    from tierfs.meta.client import MetaClient, Where
    from tierfs.meta.interfaces import LocalReplicator, ReplicaStatus, Replicator, StateMachine
    from tierfs.meta.ops import DEFAULT_LAYOUT, LayoutSpec, format_redundancy, parse_redundancy
    from tierfs.meta.service import MetaServicer, add_meta_service
    from tierfs.meta.state import ROOT_INODE, MetaStateMachine


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'tierfs.meta' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tierfs.meta.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
