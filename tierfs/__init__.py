"""TierFS: distributed, erasure-coded, tiered storage for large-model training
and inference.

The public surface is re-exported here; everything else is private to its
package.
"""

import os
from typing import TYPE_CHECKING, Any

# The meta daemon writes snapshots from a forked child (tierfs/meta/raft.py)
# that never uses gRPC. gRPC core's fork handlers (on unless this says
# otherwise, read when grpc is first imported - by tierfs.errors below) made
# that child crash with SIGSEGV while other threads were inside gRPC.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# gRPC core logs each failed TLS handshake at INFO on stderr ("I1206 ...
# ssl_transport_security.cc ... Handshake failed", once per retry: ten lines
# before the CLI's own one-line error, until stop 48). Its errors still show;
# GRPC_VERBOSITY=INFO (or DEBUG) set by the user wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from tierfs.errors import (
    ConfigError,
    CorruptError,
    ErrorCode,
    NoSpaceError,
    NotFoundError,
    NotLeaderError,
    TierFSError,
    UnavailableError,
)

if TYPE_CHECKING:
    from tierfs.client import AsyncClient, Client

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The client pulls in gRPC, pyeclib and uvloop: imported on first use so
    # that daemons importing ``tierfs.errors`` do not pay for it.
    if name in ("AsyncClient", "Client"):
        import tierfs.client

        return getattr(tierfs.client, name)
    raise AttributeError(f"module 'tierfs' has no attribute {name!r}")

__all__ = [
    "AsyncClient",
    "Client",
    "ConfigError",
    "CorruptError",
    "ErrorCode",
    "NoSpaceError",
    "NotFoundError",
    "NotLeaderError",
    "TierFSError",
    "UnavailableError",
    "__version__",
]
