"""One replica per process (torchrun's usual layout): the optimizer is the
user's own (dmodel.optimizer makes a plain one there, and users build torch's
over the model, as with torch DDP), so pyddp's step check does not run in it.
A step after backwards that all ran under no_sync(), whose gradients were
never reduced, would leave the processes apart in silence (the parameter
checksums compare synced backwards only). A process-wide step pre-hook of
torch's refuses it, as pyddp's own optimizers do: cheap per step (the wrapped
models an optimizer steps are found once per optimizer and wrap). A step given
a closure is judged after the closure ran, inside the step: the closure may
run the step's backward (Lightning's automatic optimization, and its manual
one, which passes a closure that does nothing)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._link.weak import LenientWeakKeys

# id(parameter) -> the parameter, of one-replica wrapped models across
# processes (weak: a dropped model leaves nothing); and the check of each.
_params: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_checks: Dict[int, Callable[[], Any]] = {}
_seen = LenientWeakKeys()  # optimizer -> ((parameter count, wraps), the checks it needs)
_hook: Dict[str, Any] = {"wraps": 0}  # wraps: watch_steps calls (a wrap since: look again)


def watch_steps(params: List[torch.Tensor], gradients: Callable[[], Any]) -> None:
    """Before every step of an optimizer over any of `params`, the wrapped
    model's gradients (`gradients`: a weak method giving its reducer's
    GradientShards; None once the reducer is gone) refuse unsynced ones."""
    for p in params:
        _params[id(p)] = p
        _checks[id(p)] = gradients
        weakref.finalize(p, _checks.pop, id(p), None)
    _hook["wraps"] += 1
    if "handle" not in _hook:
        _hook["handle"] = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> Any:
    if not _params:
        return None
    checks = _checks_of(optimizer)
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


def _checks_of(optimizer: Any) -> List[Callable[[], Any]]:
    """The checks of the wrapped models whose parameters `optimizer` steps."""
    groups = optimizer.param_groups
    key = (sum(len(g["params"]) for g in groups), _hook["wraps"])
    seen: Tuple[Tuple[int, int], List[Callable[[], Any]]] = _seen.get(optimizer, ((-1, -1), []))
    if seen[0] != key:
        checks: List[Callable[[], Any]] = []
        for g in groups:
            for p in g["params"]:
                check = _checks.get(id(p)) if _params.get(id(p)) is p else None
                if check is not None and all(check is not c for c in checks):
                    checks.append(check)
        seen = (key, checks)
        _seen[optimizer] = seen
    return seen[1]


def _judge(checks: List[Callable[[], Any]]) -> None:
    for check in checks:
        gradients = check()
        if gradients is not None:
            gradients().refuse_unsynced_step()
