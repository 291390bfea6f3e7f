"""The Trainer's constructor arguments, checked before any thread starts: a
wrong one raises TypeError (or ValueError) naming it and what it must be."""

from __future__ import annotations

import functools
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

from .callbacks import Callback

_TAKEN = ("loss", "valid_loss", "epoch", "step", "train_loss", "smoothed_valid_loss")


def optimizer_spec(optimizer: Any) -> Tuple[type, Tuple[Any, ...], Dict[str, Any]]:
    """(class, args, kwargs) from an optimizer class or functools.partial."""
    if isinstance(optimizer, functools.partial):
        cls, args, kwargs = optimizer.func, optimizer.args, dict(optimizer.keywords)
    else:
        cls, args, kwargs = optimizer, (), {}
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        what = f"an instance of {type(cls).__name__}" if not isinstance(cls, type) else repr(cls)
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer subclass or functools.partial(cls, "
            f"lr=...) (the Trainer builds one per replica), got {what}"
        )
    return cls, args, kwargs


def check_arguments(loss_fn: Any, scheduler: Any, metrics: Any, callbacks: Any) -> None:
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (outputs, targets) -> loss, got {loss_fn!r}")
    if scheduler is not None and not callable(scheduler):
        raise TypeError(
            "scheduler must be a function optimizer -> LR scheduler (e.g. lambda opt: "
            f"torch.optim.lr_scheduler.StepLR(opt, 10)), got {scheduler!r}"
        )
    if metrics is not None:
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must be a dict name -> fn(outputs, targets), got {metrics!r}")
        for name, fn in metrics.items():
            if not isinstance(name, str) or not callable(fn):
                raise TypeError(f"metrics[{name!r}] must be a function (outputs, targets)")
            if name in _TAKEN:
                raise ValueError(f"metrics[{name!r}]: the name is taken by the Trainer's own")
    if not isinstance(callbacks, Sequence) or not all(isinstance(c, Callback) for c in callbacks):
        raise TypeError("callbacks must be a list of pyddp.Callback instances")


def qualname(cls: Optional[type]) -> Optional[str]:
    """module.Class: how checkpoints record the optimizer and scheduler classes."""
    return None if cls is None else f"{cls.__module__}.{cls.__qualname__}"
