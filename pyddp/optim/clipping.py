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
    gradients: GradientShards, module: nn.Module, max_norm: float, norm_type: float
) -> torch.Tensor:
    """dmodel.clip_grad_norm_ (`module`: replica 0, the user's model)."""
    gradients.before_clip()
    if gradients.scatter_ranks:  # shard="gradients": blocks only
        return clip_sharded(gradients, max_norm, norm_type)
    if len(gradients.replicas) == 1:
        return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm, norm_type)
    return clip_replicas(flat_grads(gradients), max_norm, norm_type)


def clip_values(gradients: GradientShards, value: float) -> None:
    """dmodel.clip_grad_value_: torch's clip_grad_value_ on every replica's
    (reduced) gradients, each element into [-value, value]."""
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
