"""Every error pyddp raises on purpose, in one module that every room imports
(so no room imports another just for its exception types)."""

from __future__ import annotations

from . import _C

# Raised by the C++ engine and backends (bindings.cpp maps their exceptions
# to it): a reduction failed or timed out, naming the bucket and parameters.
ReduceError = _C.ReduceError


class ProcessGroupError(ReduceError):
    """A collective across processes failed or timed out (a ReduceError)."""


class ReplicaError(RuntimeError):
    """An exception raised on one replica, re-raised on the caller's thread."""

    def __init__(self, replica: int, what: str, cause: BaseException):
        super().__init__(f"replica {replica} failed during {what}: {type(cause).__name__}: {cause}")
        self.replica = replica
        self.cause = cause


class TrainingError(RuntimeError):
    """A step failed; names the replica, epoch and step. The last checkpoint is intact."""


class UnsafePathError(OSError):
    """A path pyddp writes or reads is a symbolic link or not a regular file."""
