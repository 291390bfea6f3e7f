"""Sharded optimizer state (ZeRO stage 1, as torch's ZeroRedundancyOptimizer):
`dmodel.optimizer(cls, shard=True, ...)`.

Every replica of every process is a slot; each trainable parameter belongs
to one slot (greedy by size, largest first, the same plan on every rank).
A slot's optimizer holds state for its parameters only, so optimizer state
per replica is about 1/(replicas over all processes) of the unsharded one.
At each step, every slot steps its own parameters with the reduced gradient
(the engine all-reduced it, as for any optimizer), then every replica takes
the stepped values of the parameters it does not own: copied from their
owner in this process, summed with -0.0 from every other process (x + -0.0
is x bit for bit) across processes. The result is the unsharded optimizer's
step exactly: the same arithmetic on the same values.

The object returned is an instance of a subclass of the user's optimizer
class over replica 0's parameters, so LR schedulers and `param_groups` work
as usual; its `state_dict()` is consolidated, in the unsharded optimizer's
format (loadable by the plain optimizer and back). Across processes,
`step()`, `state_dict()` and `load_state_dict()` are collective: every rank
calls them. CPU replicas only for now (GPUs: NotImplementedError)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Type

import torch

from ._link import exchange
from .errors import ReplicaError
from .sync import GradSync

SHARD_PARAMS = exchange("the gathering of a sharded optimizer step's parameters")
SHARD_STATE = exchange("the gathering of a sharded optimizer's state")

_SUBCLASSES: Dict[type, type] = {}


def plan_shards(numels: Sequence[int], slots: int) -> List[int]:
    """The owning slot of each parameter: largest first, to the least loaded
    slot (lowest index on ties), deterministic on every rank."""
    owner = [0] * len(numels)
    load = [0] * slots
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        s = min(range(slots), key=lambda s: (load[s], s))
        owner[i] = s
        load[s] += numels[i]
    return owner


def sharded_optimizer(
    sync: GradSync, cls: Type[torch.optim.Optimizer], groups: List[list], **kwargs: Any
) -> torch.optim.Optimizer:
    """`groups[r]`: replica r's parameters or param groups (as the user gave
    them, applied to each replica)."""
    if sync.streams is not None or sync.devices[0].type != "cpu":
        raise NotImplementedError(
            "pyddp: shard=True runs on CPU replicas for now; on GPUs use the unsharded "
            "optimizer (shard=False) or torch's ZeroRedundancyOptimizer under torch DDP"
        )
    opt = _sharded_class(cls)(groups[0], **kwargs)
    index = {id(p): i for i, p in enumerate(sync.params[0])}
    layout = []  # per group: the global index of each of its parameters
    for g in opt.param_groups:
        missing = [p for p in g["params"] if id(p) not in index]
        if missing:
            raise ValueError(
                "shard=True: every parameter given to the optimizer must be one the model "
                f"trains (requires_grad=True when wrapped); got {len(missing)} that are not"
            )
        layout.append([index[id(p)] for p in g["params"]])
    link = sync.link
    slots = sum(link.local_counts)
    first = sum(link.local_counts[: link.rank])  # this process's first slot
    owner = plan_shards([p.numel() for p in sync.params[0]], slots)
    inner = []
    for r in range(len(sync.replicas)):
        mine = []
        for g, idx in zip(opt.param_groups, layout):
            params = [sync.params[r][i] for i in idx if owner[i] == first + r]
            mine.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
        inner.append(cls(mine, **kwargs))
    opt._pyddp_sync = sync
    opt._pyddp_layout = layout
    opt._pyddp_owner = owner
    opt._pyddp_first = first
    opt._pyddp_inner = inner
    opt._pyddp_broken = ""
    opt._pyddp_owns_all = {i for idx in layout for i in idx} >= set(range(len(index)))
    return opt


def state_bytes(optimizer: torch.optim.Optimizer) -> List[int]:
    """Bytes of optimizer state tensors held for each replica of this
    process: a sharded optimizer's per slot; an unsharded one's (pyddp's
    replicated optimizer) per replica."""
    shards = getattr(optimizer, "_pyddp_inner", None)
    if shards is None:
        shards = [optimizer, *getattr(optimizer, "_pyddp_others", [])]
    return [_bytes(o.state) for o in shards]


def _bytes(state: Any) -> int:
    total = 0
    for per_param in state.values():
        for v in per_param.values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


def _sharded_class(cls: Type[torch.optim.Optimizer]) -> type:
    if cls in _SUBCLASSES:
        return _SUBCLASSES[cls]

    class Sharded(cls):  # type: ignore[misc, valid-type]
        def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
            if closure is not None:
                raise ValueError(
                    "pyddp optimizers do not take a closure: re-evaluating the loss would "
                    "need a forward and backward on every replica"
                )
            if self._pyddp_broken:
                raise RuntimeError(self._pyddp_broken)
            sync = self._pyddp_sync
            sync.check_step()
            if getattr(sync.link, "join", None) is not None:
                raise NotImplementedError(
                    "pyddp: a sharded optimizer (shard=True) cannot step under Join yet: the "
                    "ranks that joined would have to step their shards too; use shard=False "
                    "under dmodel.join()"
                )
            for other in self._pyddp_inner:
                # Hyper-parameters (LR schedulers) live on this object.
                for mine, theirs in zip(self.param_groups, other.param_groups):
                    for key, value in mine.items():
                        if key != "params":
                            theirs[key] = value
            try:
                sync.run_per_replica([o.step for o in self._pyddp_inner], "optimizer step")
                self._pyddp_gather()
            except BaseException as e:
                self._pyddp_broken = (
                    "pyddp: a sharded optimizer step failed part-way "
                    f"({type(e).__name__}: {e}); some shards stepped and others did not, so "
                    "the replicas differ: load a checkpoint into a new wrapped model"
                )
                if isinstance(e, ReplicaError):
                    raise ReplicaError(e.replica, "sharded optimizer step", e.cause) from e.cause
                raise
            return None

        step.hooked = True  # type: ignore[attr-defined]

        def _pyddp_gather(self) -> None:
            """Every replica takes the stepped parameters it does not own."""
            sync, owner, first = self._pyddp_sync, self._pyddp_owner, self._pyddp_first
            local = len(sync.replicas)
            n = len(sync.params[0])
            with torch.no_grad():
                # Replica 0 first: from this process's owners.
                for i in range(n):
                    r = owner[i] - first
                    if 0 < r < local:
                        sync.params[0][i].copy_(sync.params[r][i])
                if sync.link.spans_processes:
                    theirs = [i for i in range(n) if not 0 <= owner[i] - first < local]
                    ps = [sync.params[0][i] for i in range(n)]
                    flat = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in ps])
                    offsets = [0]
                    for p in ps:
                        offsets.append(offsets[-1] + p.numel())
                    for i in theirs:
                        flat[offsets[i] : offsets[i + 1]] = -0.0
                    (flat,) = sync.link.sum_tensors([flat], SHARD_PARAMS)
                    for i in theirs:
                        ps[i].copy_(flat[offsets[i] : offsets[i + 1]].view_as(ps[i]))
                for r in range(1, local):
                    torch._foreach_copy_(sync.params[r], sync.params[0])

        def zero_grad(self, set_to_none: bool = True) -> None:
            if self._pyddp_owns_all:
                self._pyddp_sync.zero_grad(set_to_none)
                return
            sync = self._pyddp_sync
            for idx in self._pyddp_layout:
                for i in idx:
                    for params in sync.params:
                        p = params[i]
                        if set_to_none:
                            p.grad = None
                        elif p.grad is not None:
                            p.grad.zero_()

        def state_dict(self) -> Dict[str, Any]:
            """The unsharded optimizer's state dict (collective across
            processes: every rank calls it, every rank gets it)."""
            local: Dict[int, Any] = {}
            for r, other in enumerate(self._pyddp_inner):
                sd = other.state_dict()
                globals_ = [
                    i
                    for idx in self._pyddp_layout
                    for i in idx
                    if self._pyddp_owner[i] == self._pyddp_first + r
                ]
                for j, value in sd["state"].items():
                    local[globals_[j]] = value
            merged: Dict[int, Any] = {}
            for part in self._pyddp_sync.link.gather_objects(local, SHARD_STATE):
                merged.update(part)
            position = {i: k for k, i in enumerate(i for idx in self._pyddp_layout for i in idx)}
            groups, k = [], 0
            for g, idx in zip(self.param_groups, self._pyddp_layout):
                groups.append({**{a: b for a, b in g.items() if a != "params"},
                               "params": list(range(k, k + len(idx)))})  # fmt: skip
                k += len(idx)
            state = {position[i]: v for i, v in sorted(merged.items(), key=lambda kv: kv[0])}
            return {"state": state, "param_groups": groups}

        def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
            """Loads an unsharded optimizer's state dict (or this one's):
            each slot takes its parameters' state."""
            groups = state_dict.get("param_groups")
            if not isinstance(groups, list) or len(groups) != len(self.param_groups):
                raise ValueError(
                    "loaded state dict has a different number of parameter groups than this "
                    "optimizer"
                )
            for g, saved, idx in zip(self.param_groups, groups, self._pyddp_layout):
                if len(saved["params"]) != len(idx):
                    raise ValueError(
                        "loaded state dict contains a parameter group that doesn't match the "
                        "size of optimizer's group"
                    )
                for key, value in saved.items():
                    if key != "params":
                        g[key] = value
            flat = [i for idx in self._pyddp_layout for i in idx]
            saved_ids = [j for g in groups for j in g["params"]]
            by_global = {
                flat[k]: state_dict["state"][j]
                for k, j in enumerate(saved_ids)
                if j in state_dict["state"]
            }
            for r, other in enumerate(self._pyddp_inner):
                owned = [
                    [i for i in idx if self._pyddp_owner[i] == self._pyddp_first + r]
                    for idx in self._pyddp_layout
                ]
                k, sub_state, sub_groups = 0, {}, []
                for g, ids in zip(self.param_groups, owned):
                    for i in ids:
                        if i in by_global:
                            sub_state[k + ids.index(i)] = by_global[i]
                    sub_groups.append({**{a: b for a, b in g.items() if a != "params"},
                                       "params": list(range(k, k + len(ids)))})  # fmt: skip
                    k += len(ids)
                # torch keeps given tensors when device and dtype match: copies,
                # so no two slots (or the caller's dict) share a buffer.
                sub = {"state": _clone(sub_state), "param_groups": sub_groups}
                other.load_state_dict(sub)

        def add_param_group(self, param_group: Dict[str, Any]) -> None:
            if hasattr(self, "_pyddp_inner"):
                raise RuntimeError(
                    "add_param_group is not supported on a pyddp optimizer: pass every group "
                    "through dmodel.optimizer(cls, params=fn) instead"
                )
            super().add_param_group(param_group)

        def __reduce_ex__(self, protocol: Any) -> Any:
            raise TypeError(
                "a pyddp optimizer steps live replicas and cannot be pickled or copied: save "
                "opt.state_dict() and load it into a new dmodel.optimizer(...)"
            )

    Sharded.__name__ = Sharded.__qualname__ = f"Sharded{cls.__name__}"
    _SUBCLASSES[cls] = Sharded
    return Sharded


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree
