"""torch's GradScaler, followed. Its `unscale_` (called by you before
clipping, or by `scaler.step(opt)`) divides the gradients of the optimizer's
parameters in place with `torch._amp_foreach_non_finite_check_and_unscale_`,
which moves no version counter. A pyddp optimizer's parameters are replica
0's, and pyddp sees gradients changed there after backward through their
version counters (engine/buckets.py's `align`, before each step), then copies
them to the other replicas. Unseen, replicas 1..N-1 would step on gradients
still multiplied by the scale. So GradScaler's `_unscale_grads_` is wrapped,
once, when pyddp makes its first optimizer: after it, the counters of the
gradients it unscaled move (pyddp's optimizers only).

Under shard="gradients" (ZeRO stage 2) the gradients on the model are
placeholders, which cannot be divided: the wrapper unscales every replica's
blocks of the reduced gradient instead, and finds an overflow in any block of
any process (the blocks' norms all-gathered, as the Trainer's loss scaling
does), so every rank skips the same steps.

The wrapper also notes which GradScaler unscaled each optimizer
(`scaler_of`): at the end of torch's Join every rank takes the last
joiner's scaler state (after_join.py), as its optimizers'."""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any, Dict, Optional

import torch
from torch.amp import GradScaler

from .._link.weak import LenientWeakKeys
from .replicated import increment_versions
from .shards import sharded_finite

# optimizer -> the GradScaler that last unscaled its gradients (weak both ways).
_SCALERS = LenientWeakKeys()


def scaler_of(optimizer: Any) -> Optional[GradScaler]:
    """The GradScaler that last unscaled `optimizer`'s gradients, if alive."""
    ref = _SCALERS.get(optimizer)
    return None if ref is None else ref()


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
        _SCALERS[optimizer] = weakref.ref(self)  # its state follows Join's last joiner
        state = getattr(optimizer, "__dict__", {}).get("_pyddp")
        if state is not None and state.reducer.gradients_sharded:
            return _unscale_blocks(state.reducer, *args, **kwargs)
        out = original(self, optimizer, *args, **kwargs)
        if state is not None:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"]]
            increment_versions([t for t in grads if t is not None])
        return out

    _unscale_grads_._pyddp_follows = True  # type: ignore[attr-defined]
    GradScaler._unscale_grads_ = _unscale_grads_  # type: ignore[method-assign]


def _unscale_blocks(
    reducer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
) -> Dict[torch.device, torch.Tensor]:
    """GradScaler's _unscale_grads_ under shard="gradients": every replica's
    blocks times `inv_scale` (torch's unscale_ multiplies so), and
    `found_inf` 1.0 where any block of any process is not finite; the result
    as GradScaler keeps it (per device)."""
    blocks = reducer.blocks
    if not allow_fp16 and any(b.dtype == torch.float16 for own in blocks for b in own):
        raise ValueError("Attempting to unscale FP16 gradients.")
    finite = sharded_finite(reducer)  # every rank alike (all-gathered norms)
    with torch.no_grad():
        for own in blocks:
            if own:
                torch._foreach_mul_(own, inv_scale.to(own[0].device))
    found_inf.fill_(0.0 if finite else 1.0)
    return {found_inf.device: found_inf}
