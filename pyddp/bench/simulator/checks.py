"""The simulator's inputs from Python (the CLI checks its own options): a
GPU, a system or a GPU count that no hardware has is refused naming the
field, rather than priced (a negative bandwidth gave 98% efficiency, a zero
one ZeroDivisionError)."""

from __future__ import annotations

import math
import numbers
from typing import Any


def numbers_of(spec: Any, positive: str, nonnegative: str = "", fractions: str = "") -> None:
    """`spec`'s fields named in `positive` must be finite numbers > 0, in
    `nonnegative` >= 0, in `fractions` in (0, 1]; ValueError naming the first
    that is not."""
    rules = [(n, "> 0", lambda v: v > 0) for n in positive.split()]
    rules += [(n, ">= 0", lambda v: v >= 0) for n in nonnegative.split()]
    rules += [(n, "in (0, 1]", lambda v: 0 < v <= 1) for n in fractions.split()]
    for name, must, ok in rules:
        value = getattr(spec, name)
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not (real and math.isfinite(value) and ok(value)):
            raise ValueError(
                f"{type(spec).__name__}.{name}={value!r}: must be a finite number {must}"
            )


def gpu_count(gpus: Any) -> int:
    """A number of GPUs: a whole number >= 1 (an int, numpy's or torch's, 8.0)."""
    try:  # (a bool, numpy's or torch's too, is no count)
        whole = "bool" not in type(gpus).__name__ + str(getattr(gpus, "dtype", ""))
        whole = whole and int(gpus) == gpus
    except (TypeError, ValueError, OverflowError):
        whole = False
    if not whole or gpus < 1:
        raise ValueError(f"gpus={gpus!r}: must be a whole number >= 1")
    return int(gpus)


def bucket_cap(cap_mb: Any) -> None:
    """A bucket cap in MiB: None (the engines' defaults) or a finite number >= 0."""
    real = isinstance(cap_mb, numbers.Real) and not isinstance(cap_mb, bool)
    if cap_mb is not None and not (real and math.isfinite(cap_mb) and cap_mb >= 0):
        raise ValueError(
            f"cap_mb={cap_mb!r}: must be None or a finite number >= 0 (0: one per parameter)"
        )
