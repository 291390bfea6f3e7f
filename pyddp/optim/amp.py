"""torch's GradScaler, followed. Its `unscale_` (called by you before
clipping, or by `scaler.step(opt)`) divides the gradients of the optimizer's
parameters in place with `torch._amp_foreach_non_finite_check_and_unscale_`,
which moves no version counter. A pyddp optimizer's parameters are replica
0's, and pyddp sees gradients changed there after backward through their
version counters (engine/buckets.py's `align`, before each step), then copies
them to the other replicas. Unseen, replicas 1..N-1 would step on gradients
still multiplied by the scale. So GradScaler's `_unscale_grads_` is wrapped,
once, when pyddp makes its first optimizer for several replicas: after it, the
counters of the gradients it unscaled move (pyddp's optimizers only)."""

from __future__ import annotations

import functools
import warnings
from typing import Any

from torch.amp import GradScaler

from .replicated import increment_versions


def follow_unscaling() -> None:
    """Wraps GradScaler._unscale_grads_ (idempotent)."""
    original = GradScaler.__dict__.get("_unscale_grads_")
    if original is None:
        warnings.warn(
            "pyddp: this torch's GradScaler has no _unscale_grads_, so pyddp cannot see its "
            "unscale_: with several replicas in one process, the other replicas would step on "
            "gradients still scaled. Use one replica per process, or pyddp's Trainer (its own "
            "loss scaling)",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    if getattr(original, "_pyddp_follows", False):
        return

    @functools.wraps(original)
    def _unscale_grads_(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, optimizer, *args, **kwargs)
        if "_pyddp" in getattr(optimizer, "__dict__", {}):
            grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
            increment_versions([t for t in grads if t is not None])
        return out

    _unscale_grads_._pyddp_follows = True  # type: ignore[attr-defined]
    GradScaler._unscale_grads_ = _unscale_grads_  # type: ignore[method-assign]
