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
owner in this process, summed with -0.0 from every other process (x + -0.0
is x bit for bit) across processes. The result is the unsharded optimizer's
step exactly: the same arithmetic on the same values.

The object returned is an instance of a subclass of the user's optimizer
class over replica 0's parameters, so LR schedulers and `param_groups` work
as usual; its `state_dict()` is consolidated, in the unsharded optimizer's
format (loadable by the plain optimizer and back). Across processes,
`step()`, `state_dict()` and `load_state_dict()` are collective: every rank
calls them.

On GPUs every replica takes the elements it does not own through the
engine's NCCL communicator, in one process as across processes
(_DeviceGather); the state dict is joined on replica 0's device."""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch

from ._link import exchange
from .errors import ReplicaError
from .optim import PyddpOptimizer
from .sync import GradSync

SHARD_PARAMS = exchange("the gathering of a sharded optimizer step's parameters")
# Named with its remedy: the usual mistake is calling state_dict() on the
# saving rank only, and this name is what the other ranks' errors show.
SHARD_STATE = exchange(
    "the gathering for a sharded optimizer's state_dict() (state_dict() is collective: "
    "every rank must call it, also to save on one rank only)"
)


# Optimizers whose update of each element depends on that element alone (and
# scalars): their state can be split inside a parameter, exactly.
ELEMENTWISE = {
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
    torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Rprop, torch.optim.ASGD,
}  # fmt: skip

Piece = Tuple[int, int, int]  # (parameter, first element, end element)


def plan_shards(numels: Sequence[int], slots: int, split: bool) -> List[List[Piece]]:
    """Each slot's pieces of the parameters (in the given order). `split`:
    the elements laid end to end are cut into `slots` equal ranges, so every
    slot holds the same share whatever the parameter sizes (one embedding
    matrix can be most of a model); else whole parameters, largest first to
    the least loaded slot. The same plan on every rank."""
    plan: List[List[Piece]] = [[] for _ in range(slots)]
    if split:
        total, start = sum(numels), 0
        bounds = [total * s // slots for s in range(slots + 1)]
        for i, n in enumerate(numels):
            for s in range(slots):
                lo, hi = max(start, bounds[s]), min(start + n, bounds[s + 1])
                if lo < hi:
                    plan[s].append((i, lo - start, hi - start))
            start += n
        return plan
    load = [0] * slots
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        s = min(range(slots), key=lambda s: (load[s], s))
        plan[s].append((i, 0, numels[i]))
        load[s] += numels[i]
    for pieces in plan:
        pieces.sort()
    return plan


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


class _Shard:
    """One local replica's share: its pieces (parameter, first, end, the
    tensor the optimizer steps: the parameter itself when whole, else a flat
    view of its elements) in the inner optimizer's order, and that optimizer."""

    def __init__(self, pieces: List[Tuple[int, int, int, torch.Tensor, bool]], optimizer: Any):
        self.pieces = pieces
        self.optimizer = optimizer

    def attach_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Split pieces step with the matching elements of the gradient. A
        parameter given new storage since (Module._apply: .half().float(),
        .to(memory_format=...)) gets its views re-pointed, state kept."""
        for k, (i, lo, hi, t, whole) in enumerate(self.pieces):
            if whole:
                continue
            p = params[i]
            if t.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
                if not p.is_contiguous():
                    raise RuntimeError(
                        "pyddp: a parameter the sharded optimizer cuts between replicas is no "
                        "longer contiguous (.to(memory_format=...) after the optimizer was "
                        "made?): make the optimizer after changing the model's layout"
                    )
                fresh = p.detach().view(-1)[lo:hi]
                self._replace(t, fresh)
                self.pieces[k] = (i, lo, hi, fresh, whole)
                t = fresh
            g = p.grad
            t.grad = None if g is None else g.detach().view(-1)[lo:hi]

    def _replace(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """The inner optimizer steps `new` where it stepped `old`, with its state."""
        opt = self.optimizer
        for group in opt.param_groups:
            group["params"] = [new if q is old else q for q in group["params"]]
        if old in opt.state:
            opt.state[new] = opt.state.pop(old)


def sharded_optimizer(
    sync: GradSync, cls: Type[torch.optim.Optimizer], groups: List[list], **kwargs: Any
) -> torch.optim.Optimizer:
    """`groups[r]`: replica r's parameters or param groups (as the user gave
    them, applied to each replica)."""
    opt = _sharded_class(cls)(groups[0], **kwargs)
    opt.state.clear()  # state made at construction (Adagrad's sum) is the shards' to hold
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
    order = [i for idx in layout for i in idx]
    link = sync.link
    slots = sum(link.local_counts)
    first = sum(link.local_counts[: link.rank])  # this process's first slot
    params0 = sync.params[0]
    split = cls in ELEMENTWISE and all(params0[i].is_contiguous() for i in order)
    plan = plan_shards([params0[i].numel() for i in order], slots, split)
    group_of = {i: g for g, idx in enumerate(layout) for i in idx}
    shards = []
    for r in range(len(sync.replicas)):
        per_group: List[list] = [[] for _ in layout]
        for k, lo, hi in plan[first + r]:
            i = order[k]
            p = sync.params[r][i]
            whole = lo == 0 and hi == p.numel()
            t = p if whole else p.detach().view(-1)[lo:hi]
            per_group[group_of[i]].append((i, lo, hi, t, whole))
        pieces, inner_groups = [], []
        for g, members in zip(opt.param_groups, per_group):
            pieces += members
            inner_groups.append({**_hyper(g), "params": [m[3] for m in members]})
        shards.append(_Shard(pieces, cls(inner_groups, **kwargs)))
    mine = range(first, first + len(shards))
    opt._pyddp_sync = sync
    opt._pyddp_layout = layout
    opt._pyddp_order = order
    # Where each parameter (in `order`) starts in the elements laid end to end.
    opt._pyddp_starts = [0]
    for i in order:
        opt._pyddp_starts.append(opt._pyddp_starts[-1] + params0[i].numel())
    opt._pyddp_shards = shards
    opt._pyddp_inner = [sh.optimizer for sh in shards]
    opt._pyddp_theirs = [pc for s, pcs in enumerate(plan) if s not in mine for pc in pcs]
    opt._pyddp_split = split
    opt._pyddp_broken = ""
    opt._pyddp_consolidated = None  # consolidate_state_dict(to=this rank)'s state
    opt._pyddp_owns_all = set(order) >= set(range(len(index)))
    opt._pyddp_grads = [params[i] for params in sync.params for i in order]
    opt._pyddp_on_gpus = None if sync.gpu_devices is None else _DeviceGather(sync, order)
    return opt


class _DeviceGather:
    """GPU replicas take the stepped elements they do not own on the devices,
    in one process or across processes alike: per dtype, one sum over every
    GPU of every process (the engine's NCCL communicator) of flat vectors in
    which each replica holds its own pieces and -0.0 everywhere else. x + -0.0
    is x bit for bit in every float dtype, in any order of summation, so the
    sum is each element's owner's value exactly. (It moves the parameters
    twice, as an all-reduce does: torch's ZeroRedundancyOptimizer broadcasts
    them once; pyddp's backends have no all-gather.)"""

    def __init__(self, sync: GradSync, order: List[int]):
        self.route = sync.device_route()
        params0 = sync.params[0]
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for i in order:
            by_dtype.setdefault(params0[i].dtype, []).append(i)
        self.offset: Dict[int, int] = {}  # parameter -> where it starts in its dtype's vector
        # Per dtype: its length, and each replica's parameters of that dtype
        # (laid end to end in `order`), their sizes and shapes.
        self.groups: List[Tuple[torch.dtype, int, List[List[torch.Tensor]], List[int], list]] = []
        for dtype, members in by_dtype.items():
            numels = [params0[i].numel() for i in members]
            for i, start in zip(members, itertools.accumulate([0] + numels)):
                self.offset[i] = start
            replicas = [[params[i] for i in members] for params in sync.params]
            shapes = [params0[i].shape for i in members]
            self.groups.append((dtype, sum(numels), replicas, numels, shapes))

    def __call__(self, shards: List[_Shard]) -> None:
        with torch.no_grad():
            for dtype, total, replicas, numels, shapes in self.groups:
                flats = []
                for r, shard in enumerate(shards):
                    flat = self.route.zeros(total, dtype, r).fill_(-0.0)
                    mine = [
                        (self.offset[i], lo, hi, t)
                        for i, lo, hi, t, _ in shard.pieces
                        if t.dtype == dtype
                    ]
                    if mine:
                        torch._foreach_copy_(
                            [flat[at + lo : at + hi] for at, lo, hi, _ in mine],
                            [t.reshape(-1) for *_, t in mine],  # whole, any layout: a copy
                        )
                    flats.append(flat)
                self.route.sum_each(flats)
                for params, flat in zip(replicas, flats):
                    values = [v.view(shape) for v, shape in zip(flat.split(numels), shapes)]
                    torch._foreach_copy_(params, values)  # any layout, channels_last included


@functools.cache  # one subclass per optimizer class
def _sharded_class(cls: Type[torch.optim.Optimizer]) -> type:
    class Sharded(PyddpOptimizer, cls):  # type: ignore[misc, valid-type]
        def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
            self._pyddp_begin_step(closure, self._pyddp_inner)
            self._pyddp_consolidated = None  # the state moves on
            sync = self._pyddp_sync
            if sync.link.join is not None:
                raise NotImplementedError(
                    "pyddp: a sharded optimizer (shard=True) cannot step under Join yet: the "
                    "ranks that joined would have to step their shards too; use shard=False "
                    "under dmodel.join()"
                )
            for r, shard in enumerate(self._pyddp_shards):
                shard.attach_grads(sync.params[r])
            try:
                sync.run_per_replica([_unhooked(o) for o in self._pyddp_inner], "optimizer step")
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

        # Not marked hooked: torch wraps this step with the optimizer step
        # hooks, which then run once per step for this object (the shards'
        # own steps run without them: _unhooked).

        def _pyddp_gather(self) -> None:
            """Every replica takes the stepped elements it does not own."""
            if self._pyddp_on_gpus is not None:
                self._pyddp_on_gpus(self._pyddp_shards)
                return
            sync = self._pyddp_sync
            local = len(sync.replicas)
            with torch.no_grad():
                # Replica 0 first: from this process's other replicas (whole
                # parameters in any layout, channels_last included).
                dst, src = [], []
                for r in range(1, local):
                    for i, lo, hi, t, whole in self._pyddp_shards[r].pieces:
                        dst.append(
                            sync.params[0][i] if whole else sync.params[0][i].view(-1)[lo:hi]
                        )
                        src.append(t)
                if dst:
                    torch._foreach_copy_(dst, src)
                if sync.link.spans_processes:
                    # The others' elements: a float64 sum to which every other
                    # process adds -0.0 (x + -0.0 == x, bit for bit).
                    order = self._pyddp_order
                    ps = [sync.params[0][i] for i in order]
                    flat = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in ps])
                    starts = self._pyddp_starts
                    for k, lo, hi in self._pyddp_theirs:
                        flat[starts[k] + lo : starts[k] + hi] = -0.0
                    (flat,) = sync.link.sum_tensors([flat], SHARD_PARAMS)
                    for k, lo, hi in self._pyddp_theirs:
                        src = flat[starts[k] + lo : starts[k] + hi]
                        if lo == 0 and hi == ps[k].numel():  # whole: any layout
                            ps[k].copy_(src.view(ps[k].shape))
                        else:
                            ps[k].view(-1)[lo:hi].copy_(src)
                for r in range(1, local):
                    torch._foreach_copy_(sync.params[r], sync.params[0])

        def consolidate_state_dict(self, to: int = 0) -> None:
            """torch's ZeroRedundancyOptimizer spelling, for ported code:
            collective (every rank calls it); afterwards rank `to` (in the
            wrapped model's group) may call state_dict() alone, until the
            next step or load. state_dict() called on every rank needs no
            consolidation."""
            link = self._pyddp_sync.link
            if not isinstance(to, int) or not 0 <= to < link.world:
                raise ValueError(f"consolidate_state_dict: to={to!r} is not a rank of the group")
            full = self.state_dict()
            self._pyddp_consolidated = full["state"] if link.rank == to else None

        def state_dict(self) -> Dict[str, Any]:
            """The unsharded optimizer's state dict (collective across
            processes: every rank calls it, every rank gets it; after
            consolidate_state_dict(to=r), rank r alone may)."""
            sizes = [len(idx) for idx in self._pyddp_layout]
            kept = self._pyddp_consolidated
            if kept is not None:  # hyper-parameters as they are now (LR schedulers)
                return {"state": kept, "param_groups": _numbered(self.param_groups, sizes)}
            sync = self._pyddp_sync
            # GPUs: pieces cross processes through the host, and are joined
            # on replica 0's device.
            travel = self._pyddp_on_gpus is not None and sync.link.spans_processes
            local = []
            for shard in self._pyddp_shards:
                saved = shard.optimizer.state_dict()["state"]
                for j, (i, lo, _, _, whole) in enumerate(shard.pieces):
                    if j in saved:
                        value = _per_element_on(saved[j], "cpu") if travel else saved[j]
                        local.append((i, lo, whole, value))
            parts: Dict[int, list] = {}
            params0 = sync.params[0]
            for got in sync.link.gather_objects(local, SHARD_STATE):
                for i, lo, whole, value in got:
                    value = _per_element_on(value, params0[i].device)
                    parts.setdefault(i, []).append((lo, whole, value))
            position = {i: k for k, i in enumerate(self._pyddp_order)}
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
            return {"state": state, "param_groups": _numbered(self.param_groups, sizes)}

        def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
            """Loads an unsharded optimizer's state dict (or this one's):
            each shard takes its pieces' state."""
            self._pyddp_consolidated = None
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
            saved_ids = [j for g in groups for j in g["params"]]
            by_global = {
                i: state_dict["state"][j]
                for i, j in zip(self._pyddp_order, saved_ids)
                if j in state_dict["state"]
            }
            params0 = self._pyddp_sync.params[0]
            for shard in self._pyddp_shards:
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
                                f"{self._pyddp_sync.names[i]} has shape {tuple(v.shape)}, "
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
                sub_groups = _numbered(self.param_groups, sizes)
                # torch keeps given tensors when device and dtype match: copies,
                # so no two shards (or the caller's dict) share a buffer.
                shard.optimizer.load_state_dict(
                    {"state": _clone(sub_state), "param_groups": sub_groups}
                )

    Sharded.__name__ = Sharded.__qualname__ = f"Sharded{cls.__name__}"
    return Sharded


def _hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    """A param group's hyper-parameters (everything but its parameters)."""
    return {k: v for k, v in group.items() if k != "params"}


def _numbered(groups: Sequence[Dict[str, Any]], sizes: Sequence[int]) -> List[Dict[str, Any]]:
    """State-dict param groups: `groups`' hyper-parameters, their parameters
    numbered in order across groups (sizes[g] in group g), as torch does."""
    out, k = [], 0
    for g, n in zip(groups, sizes):
        out.append({**_hyper(g), "params": list(range(k, k + n))})
        k += n
    return out


def _unhooked(optimizer: Any) -> Callable[[], Any]:
    """`optimizer.step` without torch's step hooks (global and its own): a
    shard's step is part of the sharded optimizer's, whose hooks run once
    (pyddp counts optimizer steps by them, so every rank counts one)."""
    step = getattr(type(optimizer).step, "__wrapped__", None)
    return (lambda: step(optimizer)) if step is not None else optimizer.step


def _per_element_on(state: Dict[str, Any], device: Any) -> Dict[str, Any]:
    """One parameter's state with its per-element tensors on `device` (the
    scalars, a step count, stay where the optimizer keeps them)."""
    return {
        k: v.to(device) if isinstance(v, torch.Tensor) and v.dim() >= 1 else v
        for k, v in state.items()
    }


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree
