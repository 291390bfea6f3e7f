"""One replica per process (torchrun's usual layout): the optimizer is the
user's own (dmodel.optimizer makes a plain one there, and users build torch's
over the model, as with torch DDP), so pyddp's step check does not run in it.
A step after backwards that all ran under no_sync(), whose gradients were
never reduced, would leave the processes apart in silence (the parameter
checksums compare synced backwards only). A process-wide step pre-hook of
torch's refuses it, as pyddp's own optimizers do: cheap per step (the wrapped
models an optimizer steps are found once per optimizer: optim/watched.py). A step given
a closure is judged after the closure ran, inside the step: the closure may
run the step's backward (Lightning's automatic optimization, and its manual
one, which passes a closure that does nothing)."""

from __future__ import annotations

from typing import Any, Callable, List

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .watched import Found, WatchedParams


def _distinct(found: Found) -> List[Callable[[], Any]]:
    checks: List[Callable[[], Any]] = []
    for _, check in found:
        if all(check is not c for c in checks):
            checks.append(check)
    return checks


# one-replica wrapped models' parameters across processes, each with its
# model's check
_params = WatchedParams(register_optimizer_step_pre_hook, collect=_distinct)


def watch_steps(params: List[torch.Tensor], gradients: Callable[[], Any]) -> None:
    """Before every step of an optimizer over any of `params`, the wrapped
    model's gradients (`gradients`: a weak method giving its reducer's
    GradientShards; None once the reducer is gone) refuse unsynced ones."""
    _params.watch(params, _before_step, tag=gradients)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> Any:
    if not _params:
        return None
    checks = _params.found(optimizer)
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # (args[0]: the optimizer)
    if closure is None:
        _judge(checks)
        return None
    if not checks:
        return None

    def judged() -> Any:  # (torch's step calls it first, before changing anything)
        loss = closure()
        _judge(checks)
        return loss

    if len(args) > 1:
        return (args[0], judged, *args[2:]), kwargs
    return args, {**kwargs, "closure": judged}


def _judge(checks: List[Callable[[], Any]]) -> None:
    for check in checks:
        gradients = check()
        if gradients is not None:
            gradients().refuse_unsynced_step()
