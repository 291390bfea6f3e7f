"""`dmodel.optimizer(cls, params, shard=...)`: the optimizer for a wrapped
model's replicas: the plain one for a single replica, else the replicated one
(replicated.py) or, with `shard=True` ("state", ZeRO stage 1) or
`shard="gradients"` (ZeRO stage 2) and more than one replica anywhere, the
sharded one (zero.py)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Type

import torch
from torch import nn

from ..engine.faces import GradientShards
from .amp import follow_unscaling
from .replicated import replicated_optimizer
from .zero import sharded_optimizer

ParamsFn = Callable[[nn.Module], Iterable[Any]]


def make_optimizer(
    reducer: GradientShards,
    cls: Type[torch.optim.Optimizer],
    params: Optional[ParamsFn] = None,
    shard: Any = False,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer class must be a torch.optim.Optimizer subclass, got {cls!r}")
    if issubclass(cls, torch.optim.LBFGS):  # (every step of it was refused)
        raise ValueError(
            "dmodel.optimizer: LBFGS steps through a closure that re-evaluates the loss, which "
            "pyddp's optimizers do not take (it would need a forward and backward on every "
            "replica at each evaluation); run one replica per process (torchrun), where "
            "torch's own LBFGS over the model steps with your closure"
        )
    if (
        shard not in (False, True, "state", "gradients")
        or isinstance(shard, int)
        and not isinstance(shard, bool)
    ):
        raise ValueError(
            f"shard={shard!r}: use False, True or 'state' (optimizer state, ZeRO stage 1), or "
            "'gradients' (gradients and optimizer state, ZeRO stage 2)"
        )
    if reducer.scatter_ranks:
        raise RuntimeError(
            "pyddp: this model's gradients are sharded (an optimizer with shard='gradients' "
            "was made for it): every replica holds only its block of each reduced gradient, so "
            "no other optimizer can step it; make one optimizer with shard='gradients' over "
            "every parameter (param groups for different settings)"
        )
    groups = [_param_groups(m, params, ps) for m, ps in zip(reducer.replicas, reducer.params)]
    follow_unscaling()  # GradScaler's unscale_: version counters, ZeRO-2's blocks, Join's end
    if shard and (len(groups) > 1 or reducer.ranks.spans_processes):
        return sharded_optimizer(reducer, cls, groups, shard == "gradients", **kwargs)
    if len(groups) == 1:
        return cls(groups[0], **kwargs)  # one replica: the plain optimizer, no overhead
    return replicated_optimizer(reducer, cls, groups, **kwargs)


def _param_groups(module: nn.Module, params: Optional[ParamsFn], planned: list) -> list:
    """By default every parameter pyddp reduces, frozen now or not (as torch's
    optimizer over model.parameters(): a frozen one has no gradient and is
    skipped; unfrozen later, follow_unfreezing's included, it trains)."""
    if params is None:
        reduced = set(map(id, planned))
        return [p for p in module.parameters() if p.requires_grad or id(p) in reduced]
    if not callable(params):
        raise TypeError(
            "params must be a function module -> parameters or param groups (it is applied "
            "to every replica), e.g. lambda m: [{'params': m.fc.parameters(), 'lr': 0.1}]"
        )
    return list(params(module))
