"""torch's fused optimizer kernels (`fused=True`: Adam, AdamW, SGD, Adagrad)
write the parameters in place without moving their version counters, and the
counters are how the other replicas in a process see a step the user's own
optimizer took on replica 0 (replicas/mirror.py): they kept their old
weights and went on adding their gradients to the reduction, in silence
(0.016 off one device after 5 Adam steps). A process-wide step post-hook of
torch's moves the counters of the parameters a fused step wrote (those with a
gradient), for replica 0's parameters of wrapped models with several
replicas in a process: as an unfused step would have (optim/watched.py
finds them). pyddp's own optimizers keep every replica's counters in step
themselves (ReplicatedState.copy, align_versions)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from .base import PyddpOptimizer
from .replicated import increment_versions
from .watched import WatchedParams

# replica 0's parameters of wrapped models with several replicas in a
# process, in an optimizer's fused groups
_params = WatchedParams(
    register_optimizer_step_post_hook,
    collect=lambda found: [p for p, _ in found],
    groups=lambda g: bool(g.get("fused")),
)


def follow_fused_steps(params: Iterable[torch.Tensor]) -> None:
    """A fused step over any of `params` moves their version counters."""
    _params.watch(params, _after_step)


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not _params or isinstance(optimizer, PyddpOptimizer):
        return
    if not any(g.get("fused") for g in optimizer.param_groups):
        return
    written = [p for p in _params.found(optimizer) if p.grad is not None]
    if written:
        increment_versions(written)
