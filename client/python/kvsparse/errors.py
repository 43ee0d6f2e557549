"""One exception hierarchy for every failure of a kvsparse call.

Each error carries the gRPC status code and the server's message. The classes also derive from
the built-in exception a Python caller would expect (``InvalidArgument`` is a ``ValueError``,
``NotFound`` a ``LookupError``, ``DeadlineExceeded`` a ``TimeoutError``, ``Unavailable`` a
``ConnectionError``), so ``except ValueError`` keeps working around a kvsparse call.
"""

from __future__ import annotations

import grpc


class KvSparseError(Exception):
    """A kvsparse call failed. ``code`` is the gRPC status code, ``details`` the server's text."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(details)
        self.details = details
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class Cancelled(KvSparseError):
    code = grpc.StatusCode.CANCELLED


class Unknown(KvSparseError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(KvSparseError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(KvSparseError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(KvSparseError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KvSparseError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(KvSparseError, PermissionError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(KvSparseError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(KvSparseError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(KvSparseError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(KvSparseError, IndexError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(KvSparseError, NotImplementedError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(KvSparseError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(KvSparseError, ConnectionError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(KvSparseError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(KvSparseError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: dict[grpc.StatusCode, type[KvSparseError]] = {
    cls.code: cls
    for cls in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
}


def from_rpc_error(error: grpc.RpcError) -> KvSparseError:
    """The kvsparse exception of a failed gRPC call (its code and the server's message)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    cls = _BY_CODE.get(code, KvSparseError)
    return cls(details or code.name, code)


def from_code(code: grpc.StatusCode, details: str) -> KvSparseError:
    """The kvsparse exception of a status code (for errors found before a call is made)."""
    return _BY_CODE.get(code, KvSparseError)(details, code)
