"""How a sharded optimizer's state is cut between replicas (plan_shards), one
local replica's share (Shard), and how GPU replicas take the stepped elements
they do not own (DeviceGather)."""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .._link.route import DeviceRoute
from ..engine.reducer import Reducer

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


class Shard:
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


class DeviceGather:
    """GPU replicas take the stepped elements they do not own on the devices,
    in one process or across processes alike: per dtype, one sum over every
    GPU of every process (the engine's NCCL communicator) of flat vectors in
    which each replica holds its own pieces and -0.0 everywhere else. x + -0.0
    is x bit for bit in every float dtype, in any order of summation, so the
    sum is each element's owner's value exactly. (It moves the parameters
    twice, as an all-reduce does: torch's ZeroRedundancyOptimizer broadcasts
    them once; pyddp's backends have no all-gather.)"""

    def __init__(self, sync: Reducer, order: List[int]):
        # Sums outside the buckets on the engine's NCCL communicator (every
        # GPU of every process), on the current streams.
        self.route = DeviceRoute(sync.backend, sync.gpu_devices, sync.streams)
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

    def __call__(self, shards: List[Shard]) -> None:
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
