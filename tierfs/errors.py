"""The TierFS exception tree and its one mapping to and from the wire.

Every error a caller can see derives from :class:`TierFSError` and carries an
:class:`ErrorCode` from ``proto/tierfs/v1/common.proto``. Errors that have a
builtin counterpart also inherit it (``NotFoundError`` is a
``FileNotFoundError``), so ordinary ``except`` clauses work.

gRPC: the code travels in trailing metadata (``tierfs-code``), the leader hint
in ``tierfs-leader``; :func:`abort` and :func:`from_grpc` are the only two
places that translate. The data plane sends the numeric code in its response
header and uses :func:`error_from_code` to rebuild the exception.
"""

from __future__ import annotations

import errno as _errno
import functools
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, NoReturn, TypeVar

import grpc

from tierfs.proto.v1 import common_pb2

ErrorCode = common_pb2.ErrorCode

__all__ = [
    "ERROR_CODE_KEY",
    "AlreadyExistsError",
    "BusyError",
    "CapabilityExpiredError",
    "ConfigError",
    "CorruptError",
    "CrossDeviceError",
    "DirectoryNotEmptyError",
    "ErrorCode",
    "InsufficientTargetsError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidRenameError",
    "IsADirectoryError_",
    "NameTooLongError",
    "NoSpaceError",
    "NotADirectoryError_",
    "NotFoundError",
    "NotLeaderError",
    "NotPermittedError",
    "PermissionDeniedError",
    "ProtocolError",
    "SessionExpiredError",
    "StaleVersionError",
    "TierFSError",
    "TimeoutError_",
    "UnauthenticatedError",
    "UnavailableError",
    "UnsupportedError",
    "abort",
    "error_from_code",
    "from_grpc",
    "grpc_errors",
]

_REGISTRY: dict[int, type[TierFSError]] = {}


class TierFSError(Exception):
    """Base of every TierFS error. ``code`` is the wire identity."""

    code: ClassVar[int] = ErrorCode.ERROR_CODE_INTERNAL
    #: gRPC status used when this error crosses a gRPC boundary.
    grpc_status: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    #: errno for the OSError-derived members (used by FUSE and str()).
    errno_value: ClassVar[int] = _errno.EIO
    #: A batch put that raised: each key's outcome (True stored, False there
    #: already, None not stored), as far as the client knows; None otherwise.
    batch_results: list[bool | None] | None = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "code" in cls.__dict__:
            if cls.code in _REGISTRY:
                raise TypeError(f"duplicate ErrorCode {cls.code} for {cls.__name__}")
            _REGISTRY[cls.code] = cls

    def __init__(self, message: str = "") -> None:
        if isinstance(self, OSError):
            OSError.__init__(self, self.errno_value, message)
        else:
            Exception.__init__(self, message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message,))

    @property
    def code_name(self) -> str:
        return ErrorCode.Name(self.code)  # type: ignore[arg-type]


class InternalError(TierFSError):
    """A bug or an unexpected failure inside TierFS."""


_REGISTRY[ErrorCode.ERROR_CODE_INTERNAL] = InternalError


class InvalidArgumentError(TierFSError, ValueError):
    code = ErrorCode.ERROR_CODE_INVALID_ARGUMENT
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT
    errno_value = _errno.EINVAL


class NotFoundError(TierFSError, FileNotFoundError):
    code = ErrorCode.ERROR_CODE_NOT_FOUND
    grpc_status = grpc.StatusCode.NOT_FOUND
    errno_value = _errno.ENOENT


class AlreadyExistsError(TierFSError, FileExistsError):
    code = ErrorCode.ERROR_CODE_ALREADY_EXISTS
    grpc_status = grpc.StatusCode.ALREADY_EXISTS
    errno_value = _errno.EEXIST


class NotADirectoryError_(TierFSError, NotADirectoryError):
    code = ErrorCode.ERROR_CODE_NOT_A_DIRECTORY
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION
    errno_value = _errno.ENOTDIR


class IsADirectoryError_(TierFSError, IsADirectoryError):
    code = ErrorCode.ERROR_CODE_IS_A_DIRECTORY
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION
    errno_value = _errno.EISDIR


class DirectoryNotEmptyError(TierFSError, OSError):
    code = ErrorCode.ERROR_CODE_DIRECTORY_NOT_EMPTY
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION
    errno_value = _errno.ENOTEMPTY


class NameTooLongError(TierFSError, OSError):
    code = ErrorCode.ERROR_CODE_NAME_TOO_LONG
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT
    errno_value = _errno.ENAMETOOLONG


class PermissionDeniedError(TierFSError, PermissionError):
    code = ErrorCode.ERROR_CODE_PERMISSION_DENIED
    grpc_status = grpc.StatusCode.PERMISSION_DENIED
    errno_value = _errno.EACCES


class NotPermittedError(PermissionDeniedError):
    """EPERM rather than EACCES: an operation reserved to an inode's owner or
    root (chmod, chown, chgrp). Same wire code as its base; the message
    starts with :attr:`PREFIX`, which is how :func:`error_from_code` tells
    the two apart on the receiving side."""

    errno_value = _errno.EPERM
    PREFIX: ClassVar[str] = "operation not permitted: "


class UnauthenticatedError(TierFSError, PermissionError):
    """No valid credential: missing, malformed, unknown, revoked or expired
    token (meta), missing or forged capability (data plane)."""

    code = ErrorCode.ERROR_CODE_UNAUTHENTICATED
    grpc_status = grpc.StatusCode.UNAUTHENTICATED
    errno_value = _errno.EACCES


class CapabilityExpiredError(TierFSError, PermissionError):
    """A data-plane capability expired (or its key was rotated out): the
    client asks meta for a fresh one and retries."""

    code = ErrorCode.ERROR_CODE_CAPABILITY_EXPIRED
    grpc_status = grpc.StatusCode.PERMISSION_DENIED
    errno_value = _errno.EACCES


class NotLeaderError(TierFSError):
    """Sent by a meta follower. ``leader`` is the leader's gRPC address, or ""
    while an election is in progress."""

    code = ErrorCode.ERROR_CODE_NOT_LEADER
    grpc_status = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str = "", leader: str = "") -> None:
        super().__init__(message or (f"not the leader; leader is {leader}" if leader else "not the leader; no leader elected"))
        self.leader = leader

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.leader))


class UnavailableError(TierFSError, ConnectionError):
    code = ErrorCode.ERROR_CODE_UNAVAILABLE
    grpc_status = grpc.StatusCode.UNAVAILABLE
    errno_value = _errno.EHOSTUNREACH


class TimeoutError_(TierFSError, TimeoutError):
    code = ErrorCode.ERROR_CODE_TIMEOUT
    grpc_status = grpc.StatusCode.DEADLINE_EXCEEDED
    errno_value = _errno.ETIMEDOUT


class NoSpaceError(TierFSError, OSError):
    code = ErrorCode.ERROR_CODE_NO_SPACE
    grpc_status = grpc.StatusCode.RESOURCE_EXHAUSTED
    errno_value = _errno.ENOSPC


class CorruptError(TierFSError, OSError):
    """Stored bytes failed their checksum. Never returned as data."""

    code = ErrorCode.ERROR_CODE_CORRUPT
    grpc_status = grpc.StatusCode.DATA_LOSS
    errno_value = _errno.EIO


class StaleVersionError(TierFSError):
    """The caller's placement-group (or layout) version is out of date."""

    code = ErrorCode.ERROR_CODE_STALE_VERSION
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class BusyError(TierFSError, OSError):
    """Another writer holds the file's write session."""

    code = ErrorCode.ERROR_CODE_BUSY
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION
    errno_value = _errno.EBUSY


class SessionExpiredError(TierFSError):
    code = ErrorCode.ERROR_CODE_SESSION_EXPIRED
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class ProtocolError(TierFSError):
    """A malformed, truncated or oversized frame on the data plane."""

    code = ErrorCode.ERROR_CODE_PROTOCOL
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT


class ConfigError(TierFSError, ValueError):
    """A configuration value is invalid. ``field`` names it."""

    code = ErrorCode.ERROR_CODE_CONFIG
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT
    errno_value = _errno.EINVAL

    def __init__(self, message: str = "", field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.reason = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.reason, self.field))


class InsufficientTargetsError(TierFSError):
    """Not enough healthy targets (or distinct nodes) for the redundancy asked."""

    code = ErrorCode.ERROR_CODE_INSUFFICIENT_TARGETS
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION


class UnsupportedError(TierFSError):
    code = ErrorCode.ERROR_CODE_UNSUPPORTED
    grpc_status = grpc.StatusCode.UNIMPLEMENTED
    errno_value = _errno.ENOTSUP


class CrossDeviceError(TierFSError, OSError):
    code = ErrorCode.ERROR_CODE_CROSS_DEVICE
    grpc_status = grpc.StatusCode.FAILED_PRECONDITION
    errno_value = _errno.EXDEV


class InvalidRenameError(TierFSError, OSError):
    """Rename of a directory into its own subtree (or onto an ancestor)."""

    code = ErrorCode.ERROR_CODE_INVALID_RENAME
    grpc_status = grpc.StatusCode.INVALID_ARGUMENT
    errno_value = _errno.EINVAL


def error_from_code(code: int, message: str, leader: str = "") -> TierFSError:
    """Rebuild the exception for a wire code (unknown codes become internal)."""
    cls = _REGISTRY.get(code)
    if cls is None:
        return InternalError(f"unknown error code {code}: {message}")
    if cls is NotLeaderError:
        return NotLeaderError(message, leader=leader)
    if cls is PermissionDeniedError and message.startswith(NotPermittedError.PREFIX):
        return NotPermittedError(message)
    return cls(message)


# --- gRPC: the one place errors cross it -----------------------------------

_MD_CODE = "tierfs-code"
#: The trailing metadata key that marks a TierFS error (its ErrorCode).
ERROR_CODE_KEY = _MD_CODE
_MD_LEADER = "tierfs-leader"


def _metadata(err: TierFSError) -> tuple[tuple[str, str], ...]:
    md: tuple[tuple[str, str], ...] = ((_MD_CODE, str(int(err.code))),)
    if isinstance(err, NotLeaderError) and err.leader:
        md += ((_MD_LEADER, err.leader),)
    return md


async def abort(context: grpc.aio.ServicerContext[Any, Any], err: TierFSError) -> NoReturn:
    """End the current RPC with ``err`` (server side)."""
    await context.abort(err.grpc_status, err.message, trailing_metadata=_metadata(err))
    raise AssertionError("unreachable: context.abort returned")  # pragma: no cover


def from_grpc(exc: grpc.RpcError, service: str = "meta service") -> TierFSError:
    """Turn a failed RPC (client side) into the matching TierFSError;
    ``service`` names who did not answer, in an UNAVAILABLE's message."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else None) or str(code)
    md: dict[str, str] = {}
    trailing: Any = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for item in trailing or ():
        k, v = item[0], item[1]
        md[str(k)] = v if isinstance(v, str) else bytes(v).decode()
    if _MD_CODE in md:
        return error_from_code(int(md[_MD_CODE]), details, leader=md.get(_MD_LEADER, ""))
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return UnavailableError(f"{service} unavailable: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError_(f"deadline exceeded: {details}")
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return UnsupportedError(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # gRPC's own refusal of a message over its size limit (ours carry a code).
        return InvalidArgumentError(f"message refused: {details}")
    return InternalError(f"{code}: {details}")


_F = TypeVar("_F", bound=Callable[..., Awaitable[Any]])


def grpc_errors(fn: _F) -> _F:
    """Decorate an async servicer method: TierFSError -> abort with its code;
    any other exception -> INTERNAL (logged by grpc), never a raw traceback."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            return await fn(self, request, context)
        except TierFSError as err:
            await abort(context, err)
        except (grpc.aio.AbortError, grpc.RpcError):
            raise
        except Exception as exc:
            await abort(context, InternalError(f"{type(exc).__name__}: {exc}"))

    return wrapper  # type: ignore[return-value]
