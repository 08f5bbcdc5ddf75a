"""TierFS: distributed, erasure-coded, tiered storage for large-model training
and inference.

The public surface is re-exported here; everything else is private to its
package.
"""

from tierfs.client import AsyncClient, Client
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

__version__ = "0.1.0"

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
