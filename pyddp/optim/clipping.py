"""A wrapped model's gradients where the reducer holds them (every replica's
flat buckets; under shard='gradients' their blocks, where `.grad` is a
placeholder torch's own clipping cannot write): dmodel.clip_grad_norm_ and
clip_grad_value_, and the Trainer's loss-scaling views of them."""

from __future__ import annotations

import numbers
from functools import partial
from typing import Callable, List, Optional

import torch
from torch import nn

from ..engine.faces import GradientShards
from .replicated import clip_replicas
from .shards import clip_sharded, sharded_finite


def clip_norm(
    gradients: GradientShards,
    module: nn.Module,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: Optional[bool],
) -> torch.Tensor:
    """dmodel.clip_grad_norm_ (`module`: replica 0, the user's model)."""
    _check_flags(error_if_nonfinite, foreach)
    gradients.before_clip()
    if gradients.scatter_ranks:  # shard="gradients": blocks only
        return clip_sharded(gradients, max_norm, norm_type, error_if_nonfinite)
    if len(gradients.replicas) == 1:
        return torch.nn.utils.clip_grad_norm_(
            module.parameters(), max_norm, norm_type, error_if_nonfinite, foreach
        )
    grads0 = [p.grad for p in module.parameters() if p.grad is not None]
    return clip_replicas(grads0, flat_grads(gradients), max_norm, norm_type, error_if_nonfinite)


def _check_flags(error_if_nonfinite: bool, foreach: Optional[bool]) -> None:
    """torch's keywords, taken for a drop-in call (`foreach`: pyddp clips its
    flat buckets or blocks with foreach kernels whatever it says)."""
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(f"error_if_nonfinite must be True or False, got {error_if_nonfinite!r}")
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(f"foreach must be None, True or False, got {foreach!r}")


def clip_values(gradients: GradientShards, value: float, foreach: Optional[bool]) -> None:
    """dmodel.clip_grad_value_: torch's clip_grad_value_ on every replica's
    (reduced) gradients, each element into [-value, value]."""
    _check_flags(False, foreach)
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"clip_value must be a number, got {type(value).__name__}")
    if not value >= 0:
        raise ValueError(f"clip_value must be >= 0, got {value}")
    gradients.before_clip()
    with torch.no_grad():
        for grads in flat_grads(gradients):
            if grads:
                torch._foreach_clamp_min_(grads, -float(value))
                torch._foreach_clamp_max_(grads, float(value))


def flat_grads(gradients: GradientShards) -> List[List[torch.Tensor]]:
    """Each replica's gradients as the reducer holds them (the flat buckets,
    the blocks under shard='gradients', or `.grad` where nothing is reduced)."""
    return [gradients.flat_grads(r) for r in range(len(gradients.replicas))]


def finite_check(gradients: GradientShards) -> Optional[Callable[[], bool]]:
    """Under shard='gradients', the check that every replica's blocks (of
    every process) are finite, for fp16 loss scaling; else None (replica 0's
    reduced gradients hold every value)."""
    return partial(sharded_finite, gradients) if gradients.scatter_ranks else None
