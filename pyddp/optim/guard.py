"""Under sharded gradients (shard='gradients') each replica holds the reduced
gradient in its own block of every bucket only: any optimizer but the sharded
one would step half-reduced values. dmodel.optimizer refuses to make one; an
optimizer the user builds over the model's parameters (before or after) is
refused at its first step, by a global step pre-hook of torch's."""

from __future__ import annotations

import weakref
from typing import Any, Dict

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._link.weak import LenientWeakKeys

# id(parameter) -> the parameter, for every replica's parameters of every
# model whose gradients are sharded (weak: a dropped model leaves nothing).
_sharded: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_checked = LenientWeakKeys()  # optimizer -> parameters checked (-1: the sharded one)
_hook: Dict[str, Any] = {}


def guard(params: Any, owner: Any) -> None:
    """`params`' gradients are sharded from now on; `owner` (the sharded
    optimizer) is the one allowed to step them."""
    for p in params:
        _sharded[id(p)] = p
    _checked[owner] = -1  # never checked: it is the one that steps them
    if "handle" not in _hook:
        _hook["handle"] = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not _sharded:
        return
    inner = optimizer
    for _ in range(4):  # a trainer's wrapper (accelerate's AcceleratedOptimizer) around it
        if _checked.get(inner) == -1:
            return
        inner = getattr(inner, "optimizer", None)
        if inner is None:
            break
    groups = optimizer.param_groups
    count = sum(len(g["params"]) for g in groups)
    if _checked.get(optimizer) in (-1, count):
        return  # checked already with this many parameters (add_param_group checks again)
    for g in groups:
        for p in g["params"]:
            if _sharded.get(id(p)) is p:
                raise RuntimeError(
                    f"pyddp: {type(optimizer).__name__} steps a parameter of a wrapped model "
                    "whose gradients are sharded (dmodel.optimizer(..., shard='gradients')): "
                    "each replica holds only its block of each reduced gradient, so this "
                    "optimizer would step half-reduced values. Step the model with its sharded "
                    "optimizer only (param groups for different settings)"
                )
    _checked[optimizer] = count
