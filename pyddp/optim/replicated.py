"""The replicated optimizer: one object that steps every replica. It is an
instance of a subclass of the user's optimizer class holding replica 0's
parameters, so LR schedulers, `isinstance` checks and `state_dict()` (one
copy) work unchanged; the other replicas' optimizers are stepped with the same
hyper-parameters."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Type

import torch

from ..engine.faces import GradientShards
from ..errors import ReplicaError
from .base import OptimState, PyddpOptimizer


@dataclass
class ReplicatedState(OptimState):
    """Besides OptimState: the optimizers of replicas 1..N-1."""

    others: List[torch.optim.Optimizer]

    def optimizers(self, outer: Any) -> List[Any]:
        return [outer, *self.others]


def replicated_optimizer(
    reducer: GradientShards, cls: Type[torch.optim.Optimizer], groups: List[list], **kwargs: Any
) -> torch.optim.Optimizer:
    """`groups[r]`: replica r's parameters or param groups."""
    opt = _replicated_class(cls)(groups[0], **kwargs)
    others = [cls(g, **kwargs) for g in groups[1:]]
    mine = {id(p) for group in opt.param_groups for p in group["params"]}
    grads = [p for o in (opt, *others) for g in o.param_groups for p in g["params"]]
    owns_all = mine >= {id(p) for p in reducer.params[0]}
    opt._pyddp = ReplicatedState(reducer=reducer, grads=grads, owns_all=owns_all, others=others)
    return opt


@functools.cache  # one subclass per optimizer class
def _replicated_class(cls: Type[torch.optim.Optimizer]) -> type:
    class Replicated(PyddpOptimizer, cls):  # type: ignore[misc, valid-type]
        def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
            self._pyddp_begin_step(closure, self._pyddp.others)
            steps = [super().step] + [other.step for other in self._pyddp.others]
            try:
                return self._pyddp.reducer.run_per_replica(steps, "optimizer step")[0]
            except ReplicaError as e:
                # Some replicas stepped and some did not: make them all replica
                # 0 again (the user's model) before anything else runs.
                raise ReplicaError(e.replica, self._pyddp_resync(e.replica), e.cause) from e.cause
            except BaseException:  # Ctrl-C: the replicas may have stepped unevenly too
                self._pyddp_resync(0)
                raise

        def _pyddp_resync(self, failed: int) -> str:
            done = (
                "raised part-way (its parameters and state as they were then)"
                if failed == 0
                else "completed its step"
            )
            try:
                with torch.no_grad():
                    for other in self._pyddp.others:
                        for mine, theirs in zip(self.param_groups, other.param_groups):
                            for p0, p in zip(mine["params"], theirs["params"]):
                                p.copy_(p0)
                        other.load_state_dict(copy.deepcopy(self.state_dict()))
            except Exception as e:  # the replicas now differ: refuse every later step
                self._pyddp.broken = (
                    f"pyddp: an optimizer step failed on replica {failed} and copying replica "
                    f"0's parameters and optimizer state to the other replicas failed too "
                    f"({type(e).__name__}: {e}); the replicas differ: wrap the model again"
                )
                return f"optimizer step; the replicas now differ ({self._pyddp.broken})"
            return (
                "optimizer step; every replica's parameters and optimizer state were reset to "
                f"replica 0's, which {done}"
            )

        def _pyddp_add_group(self, param_group: Dict[str, Any]) -> None:
            """`param_group["params"]` are the wrapped model's (replica 0's)
            parameters; each replica's optimizer gets its own copies' group."""
            state = self._pyddp
            reducer, others = state.reducer, state.others
            params = param_group.get("params")
            params = [params] if isinstance(params, torch.Tensor) else list(params or [])
            index = {id(p): i for i, p in enumerate(reducer.params[0])}
            unknown = [p for p in params if id(p) not in index]
            if unknown:
                raise ValueError(
                    f"add_param_group: {len(unknown)} parameter(s) are not trainable parameters "
                    "of the wrapped model (replica 0's, requires_grad=True when wrapped); pyddp "
                    "steps each replica's own copy of the ones it knows"
                )
            # The user's class: PyddpOptimizer's own would call back here.
            super(PyddpOptimizer, self).add_param_group({**param_group, "params": params})  # type: ignore[misc]
            for r, other in enumerate(others, start=1):
                copies = [reducer.params[r][index[id(p)]] for p in params]
                other.add_param_group({**param_group, "params": copies})
            state.grads += [p for ps in reducer.params for p in (ps[index[id(q)]] for q in params)]
            mine = {id(p) for group in self.param_groups for p in group["params"]}
            state.owns_all = mine >= {id(p) for p in reducer.params[0]}

        # The parent's step is already wrapped with the optimizer's step hooks;
        # marking this one as wrapped keeps each hook to one call per step.
        step.hooked = True  # type: ignore[attr-defined]

        def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
            super().load_state_dict(state_dict)
            for other in self._pyddp.others:
                # torch keeps the given state tensors when device and dtype match:
                # each replica needs its own, or one buffer would be stepped N times.
                other.load_state_dict(copy.deepcopy(state_dict))

    Replicated.__name__ = Replicated.__qualname__ = f"Replicated{cls.__name__}"
    return Replicated


def clip_replicas(
    flats: Sequence[Sequence[torch.Tensor]], max_norm: float, norm_type: float
) -> torch.Tensor:
    """dmodel.clip_grad_norm_ over replicas that each hold the whole reduced
    gradient (`flats[r]`: replica r's flat buckets): the norm is replica
    0's, and every replica scales by the same coefficient. Returns it."""
    norms = [
        torch.linalg.vector_norm(f, norm_type, dtype=torch.promote_types(f.dtype, torch.float32))
        for f in flats[0]  # replicas hold the same reduced values
    ]
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in flats:
        torch._foreach_mul_(list(grads), coef.to(grads[0].device))
    return total
