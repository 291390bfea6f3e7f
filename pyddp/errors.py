"""Every error pyddp raises on purpose, in one module that every room imports
(so no room imports another just for its exception types)."""

from __future__ import annotations

import functools
from typing import Any

from . import _C

# Raised by the C++ engine and backends (bindings.cpp maps their exceptions
# to it): a reduction failed or timed out, naming the bucket and parameters.
ReduceError = _C.ReduceError


class ProcessGroupError(ReduceError):
    """A collective across processes failed or timed out (a ReduceError)."""


class ReplicaError(RuntimeError):
    """An exception raised on one replica, re-raised on the caller's thread.
    It is also an instance of the replica's exception's type where Python
    can make one (not an OSError's): `except torch.OutOfMemoryError` or
    `except ValueError` around a step catch it as on one device, and it
    carries that exception's attributes."""

    def __new__(cls, replica: int, what: str, cause: BaseException) -> ReplicaError:
        if cls is ReplicaError and not isinstance(cause, ReplicaError):
            cls = _replica_error_of(type(cause))
        return super().__new__(cls, replica, what, cause)  # (see _replica_error_of)

    def __init__(self, replica: int, what: str, cause: BaseException):
        # Not the other type's __init__, which may take other arguments
        # (dynamo's BackendCompilerFailed: a TypeError hid the failure).
        message = f"replica {replica} failed during {what}: {type(cause).__name__}: {cause}"
        BaseException.__init__(self, message)
        for name, value in getattr(cause, "__dict__", {}).items():
            self.__dict__.setdefault(name, value)
        self.replica, self.what, self.cause = replica, what, cause

    __str__ = BaseException.__str__  # (not the other type's: KeyError quotes its message)

    def __reduce__(self) -> Any:  # (the class is made here: rebuilt, not looked up)
        return ReplicaError, (self.replica, self.what, self.cause)


@functools.cache
def _replica_error_of(kind: type) -> type:
    """ReplicaError, and `kind` too where their layouts combine (OSError's
    types make their instances themselves: not these)."""
    if issubclass(kind, (ReplicaError, OSError)) or not issubclass(kind, Exception):
        return ReplicaError
    try:
        made = type("ReplicaError", (ReplicaError, kind), {})
    except TypeError:  # a layout Python cannot combine (OSError's), or a final class
        return ReplicaError
    made.__module__, made.__qualname__ = ReplicaError.__module__, ReplicaError.__qualname__
    return made


class TrainingError(RuntimeError):
    """A step failed; names the replica, epoch and step. The last checkpoint is intact."""


class UnsafePathError(OSError):
    """A path pyddp writes or reads is a symbolic link or not a regular file."""
