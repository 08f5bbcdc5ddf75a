"""Metadata service: the Raft-replicated state machine, its journal and snapshots, and its gRPC API."""

from tierfs.meta.client import MetaClient, Where
from tierfs.meta.interfaces import LocalReplicator, ReplicaStatus, Replicator, StateMachine
from tierfs.meta.ops import DEFAULT_LAYOUT, LayoutSpec, format_redundancy, parse_redundancy
from tierfs.meta.service import MetaServicer, add_meta_service
from tierfs.meta.state import ROOT_INODE, MetaStateMachine

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
