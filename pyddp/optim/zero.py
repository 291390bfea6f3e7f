"""Sharded optimizer state (ZeRO stage 1, as torch's ZeroRedundancyOptimizer):
`dmodel.optimizer(cls, shard=True, ...)`.

Every replica of every process is a slot, and owns a share of the trained
elements (plan_shards: equal ranges of the elements laid end to end for
elementwise optimizers, else whole parameters; the same plan on every rank).
A slot's optimizer holds state for its parameters only, so optimizer state
per replica is about 1/(replicas over all processes) of the unsharded one.
At each step, every slot steps its own parameters with the reduced gradient
(the engine all-reduced it, as for any optimizer), then every replica takes
the stepped values of the parameters it does not own: copied from their
owner in this process, by all-gather from the other processes (the bytes of
each process's pieces, as torch's ZeroRedundancyOptimizer moves them once).
The result is the unsharded optimizer's step exactly: the same arithmetic on
the same values.

The object returned is an instance of a subclass of the user's optimizer
class over replica 0's parameters, so LR schedulers and `param_groups` work
as usual; its `state_dict()` is consolidated, in the unsharded optimizer's
format (loadable by the plain optimizer and back). Across processes,
`step()`, `state_dict()` and `load_state_dict()` are collective: every rank
calls them.

On GPUs every replica takes the elements it does not own by one all-gather
per dtype on the engine's backend (NCCL, or pyddp's kernel for replicas sharing
a GPU), in one process as across processes (shards.py's DeviceGather)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Type

import torch

from .._link import exchange
from ..engine.faces import GradientShards
from ..errors import ReplicaError
from ..runtime.signals import sigint_deferred
from .base import OptimState, PyddpOptimizer, consolidated
from .guard import guard
from .replicated import align_versions, versions
from .shards import (
    ELEMENTWISE,
    DeviceGather,
    HostGather,
    Shard,
    ShardStates,
    clone_tree,
    hyper_of,
    numbered,
    per_element_on,
    plan_from_buckets,
    plan_shards,
)

SHARD_PARAMS = exchange("the gathering of a sharded optimizer step's parameters")
# Named with its remedy: the usual mistake is calling state_dict() on the
# saving rank only, and this name is what the other ranks' errors show.
SHARD_STATE = exchange(
    "the gathering for a sharded optimizer's state_dict() (state_dict() is collective: "
    "every rank must call it, also to save on one rank only)"
)


def state_bytes(optimizer: torch.optim.Optimizer) -> List[int]:
    """Bytes of optimizer state tensors held for each replica of this
    process: a sharded optimizer's per slot; an unsharded one's (pyddp's
    replicated optimizer) per replica (0 for a replica that takes another
    one's step on its device); a plain optimizer's, once."""
    state = optimizer.__dict__.get("_pyddp")
    held = [optimizer] if state is None else state.optimizers(optimizer)
    return [_bytes(o.state) for o in held]


@dataclass
class ShardedState(OptimState):
    """Besides OptimState: the user's groups as global parameter indices (layout) and
    laid end to end (order), this process's shards, whether parameters are cut inside
    (split), consolidate_state_dict's, and how the stepped elements travel: on GPUs
    (on_gpus), across processes on CPUs (across)."""

    layout: List[List[int]]
    order: List[int]
    shards: List[Shard]
    split: bool
    on_gpus: Optional[DeviceGather]
    across: Optional[HostGather]
    consolidated: Optional[List[Any]] = None  # [to, its state on rank to], until a step
    states: Any = None  # the opt.state it shows: ShardStates

    @property
    def inner(self) -> List[Any]:
        return [sh.optimizer for sh in self.shards]

    def optimizers(self, outer: Any) -> List[Any]:
        return self.inner


def _bytes(state: Any) -> int:
    held = [v for per_param in state.values() for v in per_param.values()]
    return sum(v.numel() * v.element_size() for v in held if isinstance(v, torch.Tensor))


def sharded_optimizer(
    reducer: GradientShards,
    cls: Type[torch.optim.Optimizer],
    groups: List[list],
    gradients: bool = False,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """`groups[r]`: replica r's parameters or param groups (as the user gave them,
    applied to each replica); `gradients`: ZeRO stage 2."""
    opt = _sharded_class(cls)(groups[0], **kwargs)
    index = {id(p): i for i, p in enumerate(reducer.params[0])}
    layout = []  # per group: the global index of each of its parameters
    for g in opt.param_groups:
        missing = [p for p in g["params"] if id(p) not in index]
        if missing:
            raise ValueError(
                f"shard={'gradients' if gradients else True!r}: {len(missing)} parameters given "
                "are not trained by the model (frozen when wrapped? wrap(follow_unfreezing=True))"
            )
        layout.append([index[id(p)] for p in g["params"]])
    order = [i for idx in layout for i in idx]
    ranks = reducer.ranks
    slots = sum(ranks.replicas_per_rank)
    first = sum(ranks.replicas_per_rank[: ranks.rank])  # this process's first slot
    local = len(reducer.replicas)
    gpus = reducer.on_gpus
    slot_of = [reducer.slot_of(r) for r in range(local)]
    assert sorted(slot_of) == list(range(first, first + local)), slot_of
    params0 = reducer.params[0]
    split = cls in ELEMENTWISE and all(params0[i].is_contiguous() for i in order)
    numels = [params0[i].numel() for i in order]
    if gradients:
        _check_gradients(reducer, cls, split, set(order) >= set(range(len(index))), gpus)
        # The engine reduce-scatters every bucket, one block per slot (its
        # rank): a slot's shard is its block of every bucket, so the two
        # plans agree by construction, and the bucket plan is final now.
        reducer.set_scatter(slots)
        plan = plan_from_buckets(reducer.buckets, [p.numel() for p in params0], order, slots)
    else:
        plan = plan_shards(numels, slots, split)
    group_of = {i: g for g, idx in enumerate(layout) for i in idx}
    shards = []
    for r in range(local):
        per_group: List[list] = [[] for _ in layout]
        for k, lo, hi in plan[slot_of[r]]:
            i = order[k]
            p = reducer.params[r][i]
            whole = lo == 0 and hi == p.numel()
            t = p if whole else p.detach().view(-1)[lo:hi]
            per_group[group_of[i]].append((i, lo, hi, t, whole))
        pieces, inner_groups = [], []
        for g, members in zip(opt.param_groups, per_group):
            pieces += members
            inner_groups.append({**hyper_of(g), "params": [m[3] for m in members]})
        shards.append(Shard(pieces, cls(inner_groups, **kwargs)))
    if gradients:
        guard([p for params in reducer.params for p in params], opt)
    gather = (reducer, plan, order, SHARD_PARAMS)
    opt._pyddp = ShardedState(
        reducer=reducer,
        grads=[params[i] for params in reducer.params for i in order],
        owns_all=set(order) >= set(range(len(index))),
        layout=layout,
        order=order,
        shards=shards,
        split=split,
        on_gpus=DeviceGather(reducer, plan, order, slot_of) if gpus else None,
        across=None if gpus or not ranks.spans_processes else HostGather(*gather),
    )
    opt.state = opt._pyddp.states = ShardStates(opt._pyddp.inner)  # (Adagrad's made above: theirs)
    return opt


def _check_gradients(
    reducer: GradientShards, cls: type, split: bool, owns_all: bool, gpus: bool
) -> None:
    """shard='gradients' refuses, by name, what it cannot do."""
    if not split:
        raise ValueError(
            f"pyddp: shard='gradients' needs an optimizer whose update of each element depends "
            f"on that element alone (SGD, Adam, AdamW, ...) over contiguous parameters: each "
            f"replica steps the block of every bucket it reduced, cut inside parameters; "
            f"{cls.__name__} (or a non-contiguous parameter) needs shard=True"
        )
    if not owns_all:
        raise ValueError(
            "pyddp: shard='gradients' must step every parameter the model trains, frozen ones "
            "too under follow_unfreezing (pass param groups for different settings): the other "
            "parameters' gradients would be left unreduced outside each replica's block"
        )
    if reducer.hook_set:
        raise NotImplementedError(
            "pyddp: shard='gradients' with a communication hook: a hook sees and returns whole "
            "buckets, which are reduce-scattered here; use shard=True with the hook"
        )
    if reducer.ranks.spans_processes and not gpus and len(reducer.replicas) > 1:
        raise NotImplementedError(
            "pyddp: shard='gradients' across processes with several CPU replicas per process; "
            "use one replica per process (torchrun --nproc-per-node), or shard=True"
        )


@functools.cache  # one subclass per optimizer class
def _sharded_class(cls: Type[torch.optim.Optimizer]) -> type:
    class Sharded(PyddpOptimizer, cls):  # type: ignore[misc, valid-type]
        def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
            state = self._pyddp
            self._pyddp_begin_step(closure, state.inner, follow=True)
            state.states.follow(self)  # a reset by a new opt.state
            if state.reducer.under_join:  # the ranks that joined step their shards too
                state.reducer.announce_sharded_step(self)
            with sigint_deferred(escalate=True):  # a Ctrl-C lands after the step (two: now)
                self._pyddp_step_shards()
            return None

        # torch's Joinable (ported `Join([dmodel, opt])`): the model's hook shadows its steps.
        def join_hook(self, **kwargs: Any) -> Any:
            return self._pyddp.reducer.join_hook()

        join_device = property(lambda self: self._pyddp.reducer.join_place()[0])
        join_process_group = property(lambda self: self._pyddp.reducer.join_place()[1])

        def _pyddp_shadow_step(
            self, settings: List[Dict[str, Any]], grads: List[Any], amp: Dict[str, Any]
        ) -> None:
            """Under Join, on a rank that joined: the step the ranks with inputs
            announced, with their hyper-parameters, gradients (of
            step_parameters(), or None) and GradScaler's settings for a fused
            optimizer (`amp`); its own gradients put back after."""
            for group, hyper in zip(self.param_groups, settings):
                group.update(hyper)
            params = [step_parameters(self, r) for r in range(len(self._pyddp.shards))]
            for name, value in amp.items():
                if value is not None:
                    value = torch.tensor(value, dtype=torch.float32, device=params[0][0].device)
                setattr(self, name, value)
            self._pyddp_spread_settings(self._pyddp.inner)
            own = [[p.grad for p in ps] for ps in params]
            try:
                for r, ps in enumerate(params):
                    for p, g in zip(ps, grads):
                        p.grad = g if g is None or r == 0 else g.to(p.device, copy=True)
                with sigint_deferred(escalate=True):
                    self._pyddp_step_shards()
            finally:
                for name in amp:
                    self.__dict__.pop(name, None)
                for ps, gs in zip(params, own):
                    for p, g in zip(ps, gs):
                        p.grad = g

        def _pyddp_step_shards(self) -> None:
            """Every slot steps its shard, then every replica takes the
            stepped elements it does not own."""
            self._pyddp.consolidated = None  # the state moves on: state_dict() is collective again
            reducer = self._pyddp.reducer
            scattered = reducer.gradients_sharded  # shard='gradients': the reduced blocks
            for r, shard in enumerate(self._pyddp.shards):
                shard.attach_grads(reducer.params[r], grads=not scattered)
                if scattered:
                    shard.attach_blocks(reducer, r)
            before = versions(reducer.params)
            try:
                reducer.run_per_replica([_unhooked(o) for o in self._pyddp.inner], self._pyddp.kind)
                self._pyddp_gather()
                align_versions(reducer.params, before)
            except BaseException as e:
                self._pyddp.give_up(
                    "pyddp: a sharded optimizer step failed part-way "
                    f"({type(e).__name__}: {e}); some shards stepped and others did not, so "
                    "the replicas differ: load a checkpoint into a new wrapped model"
                )
                if isinstance(e, ReplicaError):
                    raise ReplicaError(e.replica, "sharded optimizer step", e.cause) from e.cause
                raise
            finally:
                if scattered:
                    for shard in self._pyddp.shards:
                        shard.detach_blocks()
            if scattered:
                reducer.after_step()  # placeholders again: is a gradient reset before the next?

        # Not marked hooked: torch's step hooks run once per step for this
        # object (the shards' own steps run without them: _unhooked).

        def _pyddp_gather(self) -> None:
            """Every replica takes the stepped elements it does not own."""
            if self._pyddp.on_gpus is not None:
                self._pyddp.on_gpus()
                return
            reducer = self._pyddp.reducer
            local = len(reducer.replicas)
            with torch.no_grad():
                # Replica 0 first, from this process's others (any layout).
                dst, src = [], []
                for r in range(1, local):
                    for i, lo, hi, t, whole in self._pyddp.shards[r].pieces:
                        dst.append(
                            reducer.params[0][i] if whole else reducer.params[0][i].view(-1)[lo:hi]
                        )
                        src.append(t)
                if dst:
                    torch._foreach_copy_(dst, src)
                if self._pyddp.across is not None:
                    self._pyddp.across()  # the other processes' elements, by all-gather
                for r in range(1, local):
                    torch._foreach_copy_(reducer.params[r], reducer.params[0])

        def consolidate_state_dict(self, to: int = 0) -> None:
            """torch's ZeroRedundancyOptimizer spelling, for ported code:
            collective (every rank calls it); afterwards rank `to` (in the
            wrapped model's group) calls state_dict() alone (the others' are refused,
            as torch's), until the next step or load: then it is collective again."""
            ranks = self._pyddp.reducer.ranks
            if not isinstance(to, int) or not 0 <= to < ranks.world:
                raise ValueError(f"consolidate_state_dict: to={to!r} is not a rank of the group")
            self._pyddp.consolidated = None
            full = self.state_dict()
            self._pyddp.consolidated = [to, full["state"] if ranks.rank == to else None]

        def state_dict(self) -> Dict[str, Any]:
            """The unsharded optimizer's state dict (collective across
            processes: every rank calls it, every rank gets it; after
            consolidate_state_dict(to=r), rank r alone may)."""
            sizes = [len(idx) for idx in self._pyddp.layout]
            if self._pyddp.broken:  # (a half-stepped state is no checkpoint)
                raise RuntimeError(self._pyddp.broken)
            kept = self._pyddp.consolidated
            if kept is not None:  # hyper-parameters as they are now (LR schedulers)
                state = consolidated(kept, self._pyddp.reducer.ranks.rank)
                return {"state": state, "param_groups": numbered(self.param_groups, sizes)}
            reducer = self._pyddp.reducer
            # GPUs: pieces cross processes through the host, and are joined
            # on replica 0's device.
            travel = self._pyddp.on_gpus is not None and reducer.ranks.spans_processes
            local = []
            for shard in self._pyddp.shards:
                saved = shard.optimizer.state_dict()["state"]
                for j, (i, lo, _, _, whole) in enumerate(shard.pieces):
                    if j in saved:
                        value = per_element_on(saved[j], "cpu") if travel else saved[j]
                        local.append((i, lo, whole, value))
            parts: Dict[int, list] = {}
            params0 = reducer.params[0]
            for got in reducer.ranks.gather(local, SHARD_STATE):
                for i, lo, whole, value in got:
                    value = per_element_on(value, params0[i].device)
                    parts.setdefault(i, []).append((lo, whole, value))
            position = {i: k for k, i in enumerate(self._pyddp.order)}
            state = {}
            for i in sorted(parts, key=lambda i: position[i]):
                pieces = sorted(parts[i], key=lambda x: x[0])
                if pieces[0][1]:  # whole
                    state[position[i]] = pieces[0][2]
                    continue
                merged = {}
                for key, value in pieces[0][2].items():
                    if isinstance(value, torch.Tensor) and value.dim() >= 1:
                        joined = torch.cat([pc[2][key] for pc in pieces])
                        merged[key] = joined.view(params0[i].shape)
                    else:  # a scalar (the step count): the same in every piece
                        merged[key] = value
                state[position[i]] = merged
            return {"state": state, "param_groups": numbered(self.param_groups, sizes)}

        def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
            """An unsharded optimizer's state dict (or this one's): each shard takes its pieces."""
            self._pyddp.consolidated = None
            groups = state_dict.get("param_groups")
            if not isinstance(groups, list) or len(groups) != len(self.param_groups):
                raise ValueError(
                    "loaded state dict has a different number of parameter groups than this "
                    "optimizer"
                )
            for g, saved, idx in zip(self.param_groups, groups, self._pyddp.layout):
                if len(saved["params"]) != len(idx):
                    raise ValueError(
                        "loaded state dict contains a parameter group that doesn't match the "
                        "size of optimizer's group"
                    )
                for key, value in saved.items():
                    if key != "params":
                        g[key] = value
            saved_ids = [j for g in groups for j in g["params"]]
            by_global = {
                i: state_dict["state"][j]
                for i, j in zip(self._pyddp.order, saved_ids)
                if j in state_dict["state"]
            }
            params0 = self._pyddp.reducer.params[0]
            for shard in self._pyddp.shards:
                sub_state = {}
                for j, (i, lo, hi, _, whole) in enumerate(shard.pieces):
                    if i not in by_global:
                        continue
                    value = by_global[i]
                    for key, v in value.items():
                        per_element = isinstance(v, torch.Tensor) and v.dim() >= 1
                        if per_element and v.numel() != params0[i].numel():
                            raise ValueError(
                                f"loaded state dict: state {key!r} of parameter "
                                f"{self._pyddp.reducer.names[i]} has shape {tuple(v.shape)}, "
                                f"the parameter {tuple(params0[i].shape)}"
                            )
                    if not whole:
                        shape = params0[i].shape
                        value = {
                            key: v.reshape(-1)[lo:hi]
                            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape == shape
                            else v
                            for key, v in value.items()
                        }
                    sub_state[j] = value
                sizes = [len(g["params"]) for g in shard.optimizer.param_groups]
                sub_groups = numbered(self.param_groups, sizes)
                # torch keeps given tensors when device and dtype match: copies,
                # so no two shards (or the caller's dict) share a buffer.
                shard.optimizer.load_state_dict(
                    {"state": clone_tree(sub_state), "param_groups": sub_groups}
                )
            self._pyddp.loads += 1  # (in the ranks' settings hash: a load on one rank only)

        def _pyddp_add_group(self, param_group: Dict[str, Any]) -> None:
            raise RuntimeError(
                "add_param_group is not supported on a sharded optimizer (shard=True): its "
                "shards were planned over the parameters it was made with; pass every group "
                "through dmodel.optimizer(cls, params=fn, shard=True) instead"
            )

    Sharded.__name__ = Sharded.__qualname__ = f"Sharded{cls.__name__}"
    return Sharded


def step_parameters(optimizer: Any, replica: int = 0) -> List[torch.Tensor]:
    """`replica`'s parameters a sharded optimizer steps, in its order."""
    state = optimizer._pyddp
    return [state.reducer.params[replica][i] for i in state.order]


def _unhooked(optimizer: Any) -> Callable[[], Any]:
    """`optimizer.step` without torch's step hooks (global and its own): a
    shard's step is part of the sharded optimizer's, whose hooks run once
    (pyddp counts optimizer steps by them, so every rank counts one)."""
    step = getattr(type(optimizer).step, "__wrapped__", None)
    return (lambda: step(optimizer)) if step is not None else optimizer.step
