"""torch's fused optimizer kernels (`fused=True`: Adam, AdamW, SGD, Adagrad)
write the parameters in place without moving their version counters, and the
counters are how the other replicas in a process see a step the user's own
optimizer took on replica 0 (replicas/mirror.py): they kept their old
weights and went on adding their gradients to the reduction, in silence
(0.016 off one device after 5 Adam steps). A process-wide step post-hook of
torch's moves the counters of the parameters a fused step wrote (those with a
gradient), for replica 0's parameters of wrapped models with several
replicas in a process: as an unfused step would have. The parameters an
optimizer steps are found once per optimizer, its parameter count and the
wraps since. pyddp's own optimizers keep every replica's counters in step
themselves (ReplicatedState.copy, align_versions)."""

from __future__ import annotations

import weakref
from typing import Any, Dict, Iterable, List, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .._link.weak import LenientWeakKeys
from .base import PyddpOptimizer
from .replicated import increment_versions

# id(parameter) -> the parameter, replica 0's of wrapped models with several
# replicas in a process (weak: a dropped model leaves nothing).
_params: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_seen = LenientWeakKeys()  # optimizer -> ((parameter count, wraps), its parameters of ours)
_hook: Dict[str, Any] = {"wraps": 0}


def follow_fused_steps(params: Iterable[torch.Tensor]) -> None:
    """A fused step over any of `params` moves their version counters."""
    for p in params:
        _params[id(p)] = p
    _hook["wraps"] += 1
    if "handle" not in _hook:
        _hook["handle"] = register_optimizer_step_post_hook(_after_step)


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not _params or isinstance(optimizer, PyddpOptimizer):
        return
    groups = optimizer.param_groups
    if not any(g.get("fused") for g in groups):
        return
    written = [p for p in _ours(optimizer, groups) if p.grad is not None]
    if written:
        increment_versions(written)


def _ours(optimizer: Any, groups: List[Dict[str, Any]]) -> List[torch.Tensor]:
    """The parameters of wrapped models that `optimizer`'s fused groups step."""
    key = (sum(len(g["params"]) for g in groups), _hook["wraps"])
    seen: Tuple[Tuple[int, int], List[torch.Tensor]] = _seen.get(optimizer, ((-1, -1), []))
    if seen[0] != key:
        ours = [
            p for g in groups if g.get("fused") for p in g["params"]
            if _params.get(id(p)) is p
        ]  # fmt: skip
        seen = (key, ours)
        _seen[optimizer] = seen
    return seen[1]
