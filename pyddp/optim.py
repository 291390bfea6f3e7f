"""One optimizer object that steps every replica. It is an instance of a
subclass of the user's optimizer class holding replica 0's parameters, so LR
schedulers, `isinstance` checks and `state_dict()` (one copy) work unchanged;
the other replicas' optimizers are stepped with the same hyper-parameters."""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Type

import torch
from torch import nn

from .errors import ReplicaError
from .sync import GradSync

ParamsFn = Callable[[nn.Module], Iterable[Any]]


def replicated_optimizer(
    sync: GradSync,
    cls: Type[torch.optim.Optimizer],
    params: Optional[ParamsFn] = None,
    shard: bool = False,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"optimizer class must be a torch.optim.Optimizer subclass, got {cls!r}")
    if not isinstance(shard, bool):
        raise TypeError(f"shard must be a bool, got {type(shard).__name__}")
    groups = [_param_groups(m, params) for m in sync.replicas]
    if shard and (len(groups) > 1 or sync.link.spans_processes):
        from .zero import sharded_optimizer

        return sharded_optimizer(sync, cls, groups, **kwargs)
    if len(groups) == 1:
        return cls(groups[0], **kwargs)  # one replica: the plain optimizer, no overhead
    opt = _replicated_class(cls)(groups[0], **kwargs)
    opt._pyddp_sync = sync
    opt._pyddp_broken = ""
    opt._pyddp_others = [cls(g, **kwargs) for g in groups[1:]]
    mine = {id(p) for group in opt.param_groups for p in group["params"]}
    opt._pyddp_owns_all = mine >= {id(p) for p in sync.params[0]}
    opt._pyddp_grads = [p for o in (opt, *opt._pyddp_others) for g in o.param_groups
                        for p in g["params"]]  # fmt: skip
    return opt


def _param_groups(module: nn.Module, params: Optional[ParamsFn]) -> list:
    if params is None:
        return [p for p in module.parameters() if p.requires_grad]
    if not callable(params):
        raise TypeError(
            "params must be a function module -> parameters or param groups (it is applied "
            "to every replica), e.g. lambda m: [{'params': m.fc.parameters(), 'lr': 0.1}]"
        )
    return list(params(module))


class PyddpOptimizer:
    """What pyddp's optimizer classes (Replicated here, Sharded in zero.py)
    add alike to the user's class, which follows this one among their bases:
    no closure, hyper-parameters set on this object (LR schedulers) reach the
    optimizers stepping the other replicas, zero_grad through GradSync's
    buckets, add_param_group on every replica, no pickling. Set on the
    instance: _pyddp_sync, _pyddp_broken, _pyddp_owns_all (it steps every
    parameter) and _pyddp_grads (every replica's parameters it steps)."""

    _pyddp_sync: GradSync
    _pyddp_broken: str
    _pyddp_owns_all: bool
    _pyddp_grads: List[torch.Tensor]
    param_groups: List[Dict[str, Any]]

    def _pyddp_begin_step(self, closure: Any, others: Sequence[Any]) -> None:
        if closure is not None:
            raise ValueError(
                "pyddp optimizers do not take a closure: re-evaluating the loss would "
                "need a forward and backward on every replica"
            )
        self._pyddp_sync.check_step()
        for other in others:
            for mine, theirs in zip(self.param_groups, other.param_groups):
                for key, value in mine.items():
                    if key != "params":
                        theirs[key] = value
        if self._pyddp_broken:
            raise RuntimeError(self._pyddp_broken)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pyddp_owns_all:
            self._pyddp_sync.zero_grad(set_to_none)  # one memset per bucket
            return
        # Only part of the model (several optimizers): leave the other
        # parameters' gradients alone. GradSync re-attaches these on the
        # next backward.
        for p in self._pyddp_grads:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """As torch's (unfreezing layers mid-run): `param_group["params"]` are
        the wrapped model's (replica 0's) parameters; each replica's
        optimizer gets its own copies' group. Not on a sharded optimizer,
        whose shards were planned over the parameters it had."""
        sync = getattr(self, "_pyddp_sync", None)
        if sync is None:  # torch's own constructor adding the groups given
            super().add_param_group(param_group)  # type: ignore[misc]  # the user's class
            return
        others = getattr(self, "_pyddp_others", None)
        if others is None:
            raise RuntimeError(
                "add_param_group is not supported on a sharded optimizer (shard=True): its "
                "shards were planned over the parameters it was made with; pass every group "
                "through dmodel.optimizer(cls, params=fn, shard=True) instead"
            )
        params = param_group.get("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        index = {id(p): i for i, p in enumerate(sync.params[0])}
        unknown = [p for p in params if id(p) not in index]
        if unknown:
            raise ValueError(
                f"add_param_group: {len(unknown)} parameter(s) are not trainable parameters "
                "of the wrapped model (replica 0's, requires_grad=True when wrapped); pyddp "
                "steps each replica's own copy of the ones it knows"
            )
        super().add_param_group({**param_group, "params": params})  # type: ignore[misc]
        for r, other in enumerate(others, start=1):
            copies = [sync.params[r][index[id(p)]] for p in params]
            other.add_param_group({**param_group, "params": copies})
        self._pyddp_grads += [p for ps in sync.params for p in (ps[index[id(q)]] for q in params)]
        mine = {id(p) for group in self.param_groups for p in group["params"]}
        self._pyddp_owns_all = mine >= {id(p) for p in sync.params[0]}

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a pyddp optimizer steps live replicas and cannot be pickled or copied: save "
            "opt.state_dict() and load it into a new dmodel.optimizer(...)"
        )


@functools.cache  # one subclass per optimizer class
def _replicated_class(cls: Type[torch.optim.Optimizer]) -> type:
    class Replicated(PyddpOptimizer, cls):  # type: ignore[misc, valid-type]
        def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
            self._pyddp_begin_step(closure, self._pyddp_others)
            steps = [super().step] + [other.step for other in self._pyddp_others]
            try:
                return self._pyddp_sync.run_per_replica(steps, "optimizer step")[0]
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
                    for other in self._pyddp_others:
                        for mine, theirs in zip(self.param_groups, other.param_groups):
                            for p0, p in zip(mine["params"], theirs["params"]):
                                p.copy_(p0)
                        other.load_state_dict(copy.deepcopy(self.state_dict()))
            except Exception as e:  # the replicas now differ: refuse every later step
                self._pyddp_broken = (
                    f"pyddp: an optimizer step failed on replica {failed} and copying replica "
                    f"0's parameters and optimizer state to the other replicas failed too "
                    f"({type(e).__name__}: {e}); the replicas differ: wrap the model again"
                )
                return f"optimizer step; the replicas now differ ({self._pyddp_broken})"
            return (
                "optimizer step; every replica's parameters and optimizer state were reset to "
                f"replica 0's, which {done}"
            )

        # The parent's step is already wrapped with the optimizer's step hooks;
        # marking this one as wrapped keeps each hook to one call per step.
        step.hooked = True  # type: ignore[attr-defined]

        def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
            super().load_state_dict(state_dict)
            for other in self._pyddp_others:
                # torch keeps the given state tensors when device and dtype match:
                # each replica needs its own, or one buffer would be stepped N times.
                other.load_state_dict(copy.deepcopy(state_dict))

    Replicated.__name__ = Replicated.__qualname__ = f"Replicated{cls.__name__}"
    return Replicated
