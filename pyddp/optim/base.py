"""What pyddp's optimizers share: one object that steps every replica is an
instance of a subclass of the user's optimizer class, with `PyddpOptimizer`
before the user's class among its bases and its state in one `OptimState`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence

import torch

from ..engine.faces import GradientShards

OPTIMIZER_STEP = "optimizer step"  # the kind of work run_per_replica runs
# What GradScaler.step sets on an optimizer that unscales in its step (fused).
AMP_STEP = ("grad_scale", "found_inf")


@dataclass
class OptimState:
    """A pyddp optimizer's own state (`opt._pyddp`): the GradSync whose
    gradients it steps, every replica's parameters it steps, whether that is
    every parameter (zero_grad then goes through the buckets), and why it
    refuses to step (a failed step left the replicas differing)."""

    reducer: GradientShards
    grads: List[torch.Tensor]
    owns_all: bool
    broken: str = field(default="", init=False)
    # State dicts a sharded optimizer loaded: the ranks compare them
    # (_link/record.py), as one loaded on one rank only steps the others'
    # shares from other state while its all-gather keeps the parameters
    # equal (unsharded, the parameter checksum sees the ranks drift apart).
    loads: int = field(default=0, init=False)
    kind: str = field(default=OPTIMIZER_STEP, init=False)  # its steps' kind of work

    def __post_init__(self) -> None:
        self.kind = self.reducer.work_name(OPTIMIZER_STEP, self)

    def give_up(self, why: str) -> None:
        """A step left the replicas differing: every later step is refused,
        and so is the model's state_dict() (a half-stepped mix) until the
        wrapped model is closed."""
        self.broken = why
        self.reducer.refuse_model_state(why)

    def optimizers(self, outer: Any) -> List[Any]:
        """The optimizers holding this one's state, one per local replica."""
        raise NotImplementedError


class PyddpOptimizer:
    """What pyddp's optimizer classes (Replicated in replicated.py, Sharded
    in zero.py) add alike to the user's class, which follows this one among
    their bases: no closure, hyper-parameters set on this object (LR
    schedulers) reach the optimizers stepping the other replicas, zero_grad
    through GradSync's buckets, no pickling. Its state is one object,
    `_pyddp` (set after the user's constructor has run, which is how
    add_param_group tells the constructor's calls from the user's)."""

    _pyddp: OptimState
    param_groups: List[Dict[str, Any]]

    def _pyddp_begin_step(self, closure: Any, others: Sequence[Any], follow: bool = False) -> None:
        """`follow`: the user's in-place edits since the forward reach the other
        replicas first (sharded: each steps its share from its own copy)."""
        if closure is not None:
            raise ValueError(
                "pyddp optimizers do not take a closure: re-evaluating the loss would "
                "need a forward and backward on every replica"
            )
        self._pyddp.reducer.check_step()
        if follow:
            self._pyddp.reducer.follow_model()
        self._pyddp_spread_settings(others)
        if self._pyddp.broken:
            raise RuntimeError(self._pyddp.broken)

    def _pyddp_spread_settings(self, others: Sequence[Any]) -> None:
        """This object's hyper-parameters (LR schedulers set them here) on
        the optimizers stepping the replicas, and GradScaler's `grad_scale`
        and `found_inf` (set here for this step when the optimizer is fused:
        its kernel unscales, or skips the step on an overflow), or their
        absence."""
        for other in others:
            for mine, theirs in zip(self.param_groups, other.param_groups):
                for key, value in mine.items():
                    if key != "params":
                        theirs[key] = value
            for name in AMP_STEP:
                if name in self.__dict__:
                    setattr(other, name, self.__dict__[name])
                else:
                    other.__dict__.pop(name, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pyddp.owns_all:
            self._pyddp.reducer.zero_grad(set_to_none)  # one memset per bucket
            return
        # Only part of the model (several optimizers): leave the other
        # parameters' gradients alone. GradSync re-attaches these on the
        # next backward.
        for p in self._pyddp.grads:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """As torch's (unfreezing layers mid-run), on every replica: see
        the class's `_pyddp_add_group`."""
        if "_pyddp" not in self.__dict__:  # torch's own constructor adding the groups given
            super().add_param_group(param_group)  # type: ignore[misc]  # the user's class
            return
        self._pyddp_add_group(param_group)

    def _pyddp_add_group(self, param_group: Dict[str, Any]) -> None:
        raise NotImplementedError

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a pyddp optimizer steps live replicas and cannot be pickled or copied: save "
            "opt.state_dict() and load it into a new dmodel.optimizer(...)"
        )


def refuse_nonfinite(total: torch.Tensor, norm_type: float) -> None:
    """clip_grad_norm_(error_if_nonfinite=True): torch's error, raised before
    any gradient is scaled (reads the norm on the host: a GPU waits)."""
    if not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be "
            "clipped (dmodel.clip_grad_norm_ with error_if_nonfinite=True); set "
            "error_if_nonfinite=False to scale the gradients by the non-finite norm anyway"
        )


def checked_norm_type(norm_type: Any) -> float:
    """dmodel.clip_grad_norm_'s norm_type: a p-norm, p > 0, or inf."""
    p = float(norm_type)
    if not p > 0:  # (NaN too)
        raise ValueError(
            f"dmodel.clip_grad_norm_: norm_type={norm_type!r} is not supported: use a p-norm "
            "with p > 0 or inf (torch's 0 counts nonzero elements and -inf takes the "
            "smallest, which the buckets' padding and gradient-free parameters, zero there, "
            "would change)"
        )
    return p


def consolidated(kept: List[Any], rank: int) -> Dict[Any, Any]:
    """state_dict() after consolidate_state_dict(to), before the next step:
    the state kept on rank `to`. Refused on the other ranks, as torch's
    ZeroRedundancyOptimizer refuses (a collective there would wait for rank
    `to`, which answers alone)."""
    to, state = kept
    if rank != to:
        raise RuntimeError(
            f"pyddp: the optimizer state was consolidated on rank {to} "
            f"(consolidate_state_dict(to={to})), not on this rank {rank}: call state_dict() "
            f"on rank {to} alone (after a consolidation, until the next step, state_dict() "
            "is not collective)"
        )
    return state
