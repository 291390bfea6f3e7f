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
    if params is not None and len(groups) > 1:
        for m, g in zip(reducer.replicas, groups):
            _refuse_others(m, g)
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
    given = params(module)
    if isinstance(given, torch.Tensor):  # (torch's own refusal, before the check iterates it)
        raise TypeError(
            "params must return an iterable of parameters or param groups, got a tensor"
        )
    return [_materialized(g) for g in _ordered(given)]


def _ordered(items: Any) -> Any:
    """A set's order differs between replicas (and runs): each replica's
    optimizer would pair its parameters otherwise (0.65 apart; a review)."""
    if isinstance(items, (set, frozenset)):
        raise TypeError(
            "params gave a set: its order differs from replica to replica, so their "
            "optimizers would not step alike; give a list (e.g. in the model's order)"
        )
    return items


def _refuse_others(module: nn.Module, groups: list) -> None:
    """Several replicas in this process: every tensor of `groups` (params
    applied to `module`) is a parameter of `module`."""
    own = set(map(id, module.parameters()))
    for g in groups:
        held = g.get("params", ()) if isinstance(g, dict) else [g]
        for t in _tensors([held] if isinstance(held, torch.Tensor) else held):
            if id(t) not in own:
                raise ValueError(
                    f"dmodel.optimizer: params returned a tensor of shape {tuple(t.shape)} that "
                    "is not a parameter of the module it was given: the function is applied to "
                    "every replica, each stepping its own parameters, so a tensor outside it (a "
                    "function that closes over your model instead of using its argument, a "
                    "learnable value kept beside the model) would be stepped once per replica. "
                    "Use the argument (lambda m: [{'params': m.fc.parameters(), 'lr': 0.1}]) "
                    "and make a learnable value an nn.Parameter of the model"
                )


def _materialized(group: Any) -> Any:
    """A param group as torch takes it, its `params` a list (a generator
    would be used up by the check)."""
    if isinstance(group, dict) and not isinstance(group.get("params"), torch.Tensor):
        return {**group, "params": list(_ordered(group.get("params", ())))}
    return group


def _tensors(items: Iterable[Any]) -> Iterable[torch.Tensor]:
    """The tensors of a group's `params`: tensors, or (name, tensor) pairs."""
    for item in items:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            item = item[1]
        if isinstance(item, torch.Tensor):
            yield item
