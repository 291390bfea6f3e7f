"""Under sharded gradients (shard='gradients') each replica holds the reduced
gradient in its own block of every bucket only: any optimizer but the sharded
one would step half-reduced values. dmodel.optimizer refuses to make one; an
optimizer the user builds over the model's parameters (before or after) is
refused at its first step, by a global step pre-hook of torch's."""

from __future__ import annotations

from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._link.weak import LenientWeakKeys
from .watched import WatchedParams

# every replica's parameters of every model whose gradients are sharded
_sharded = WatchedParams(register_optimizer_step_pre_hook, collect=bool)
_owners = LenientWeakKeys()  # the sharded optimizers: they step them


def guard(params: Any, owner: Any) -> None:
    """`params`' gradients are sharded from now on; `owner` (the sharded
    optimizer) is the one allowed to step them."""
    _owners[owner] = True
    _sharded.watch(params, _before_step)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not _sharded:
        return
    inner = optimizer
    for _ in range(4):  # a trainer's wrapper (accelerate's AcceleratedOptimizer) around it
        if _owners.get(inner):
            return
        inner = getattr(inner, "optimizer", None)
        if inner is None:
            break
    if _sharded.found(optimizer):
        raise RuntimeError(
            f"pyddp: {type(optimizer).__name__} steps a parameter of a wrapped model "
            "whose gradients are sharded (dmodel.optimizer(..., shard='gradients')): "
            "each replica holds only its block of each reduced gradient, so this "
            "optimizer would step half-reduced values. Step the model with its sharded "
            "optimizer only (param groups for different settings)"
        )
