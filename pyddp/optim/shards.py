"""How a sharded optimizer's state is cut between replicas (plan_shards), one
local replica's share (Shard), and how replicas take the stepped elements
they do not own: by all-gather, on GPUs (DeviceGather) and across processes
on CPUs (HostGather)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import MutableMapping
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

import torch

from .._link import exchange
from ..engine.faces import GradientShards
from .base import checked_norm_type, refuse_nonfinite

# Optimizers whose update of each element depends on that element alone (and
# scalars): their state can be split inside a parameter, exactly.
ELEMENTWISE = {
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
    torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.Rprop, torch.optim.ASGD,
}  # fmt: skip

Piece = Tuple[int, int, int]  # (parameter, first element, end element)
CLIP_NORMS = exchange("the gathering of each rank's gradient norm for clip_grad_norm_")


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


def plan_from_buckets(
    buckets: Sequence[Sequence[int]], numels: Sequence[int], order: List[int], slots: int
) -> List[List[Piece]]:
    """ZeRO stage 2's shards: slot s owns block s of every bucket (the
    bucket's elements padded to a multiple of `slots`, cut into equal
    blocks), as pieces (index in `order`, first, end) like plan_shards'."""
    position = {i: k for k, i in enumerate(order)}
    plan: List[List[Piece]] = [[] for _ in range(slots)]
    for members in buckets:
        block = -(-sum(numels[i] for i in members) // slots)
        start = 0
        for i in members:
            for s in range(slots):
                lo, hi = max(start, s * block), min(start + numels[i], (s + 1) * block)
                if lo < hi:
                    plan[s].append((position[i], lo - start, hi - start))
            start += numels[i]
    for pieces in plan:
        pieces.sort()
    return plan


def hyper_of(group: Dict[str, Any]) -> Dict[str, Any]:
    """A param group's hyper-parameters (everything but its parameters)."""
    return {k: v for k, v in group.items() if k != "params"}


def numbered(groups: Sequence[Dict[str, Any]], sizes: Sequence[int]) -> List[Dict[str, Any]]:
    """State-dict param groups: `groups`' hyper-parameters, their parameters
    numbered in order across groups (sizes[g] in group g), as torch does."""
    out, k = [], 0
    for g, n in zip(groups, sizes):
        out.append({**hyper_of(g), "params": list(range(k, k + n))})
        k += n
    return out


def per_element_on(state: Dict[str, Any], device: Any) -> Dict[str, Any]:
    """One parameter's state with its per-element tensors on `device` (the
    scalars, a step count, stay where the optimizer keeps them)."""
    return {
        k: v.to(device) if isinstance(v, torch.Tensor) and v.dim() >= 1 else v
        for k, v in state.items()
    }


def clone_tree(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: clone_tree(v) for k, v in tree.items()}
    return tree


class Shard:
    """One local replica's share: its pieces (parameter, first, end, the
    tensor the optimizer steps: the parameter itself when whole, else a flat
    view of its elements) in the inner optimizer's order, and that optimizer."""

    def __init__(self, pieces: List[Tuple[int, int, int, torch.Tensor, bool]], optimizer: Any):
        self.pieces = pieces
        self.optimizer = optimizer

    def attach_grads(self, params: Sequence[torch.Tensor], grads: bool = True) -> None:
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
            if grads:  # (sharded gradients: attach_blocks sets them)
                g = p.grad
                t.grad = None if g is None else g.detach().view(-1)[lo:hi]

    def attach_blocks(self, reducer: GradientShards, r: int) -> None:
        """Sharded gradients: each piece steps with its elements of replica
        r's blocks (the reduced gradient; None where the parameter holds no
        gradient, so the step skips it as on one device)."""
        for i, lo, hi, t, whole in self.pieces:
            g = reducer.block_piece(r, i, lo, hi)
            t.grad = g.view_as(t) if g is not None and whole else g

    def detach_blocks(self) -> None:
        """After the step: no piece keeps a view of the blocks (a whole
        parameter's own `.grad` would receive the next backward's gradient)."""
        for _, _, _, t, _ in self.pieces:
            t.grad = None

    def _replace(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """The inner optimizer steps `new` where it stepped `old`, with its state."""
        opt = self.optimizer
        for group in opt.param_groups:
            group["params"] = [new if q is old else q for q in group["params"]]
        if old in opt.state:
            opt.state[new] = opt.state.pop(old)


Segment = Tuple[int, int, int]  # (parameter, first element, end element)


class ShardStates(MutableMapping):
    """A sharded optimizer's `opt.state`: its shards' states, written
    through. Keys are the tensors the shards step (a replica's parameter,
    or a flat range of one where parameters are cut), values their state
    dicts, so a reset reaches every shard as on one device: `clear()`, a
    moment zeroed or replaced in place (`for s in opt.state.values(): ...`),
    or a new empty `opt.state` (follow). The unsharded state, keyed by the
    model's parameters: `state_dict()`."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self._optimizers = list(optimizers)

    def _owner(self, key: Any) -> Dict[Any, Any]:
        for o in self._optimizers:
            if key in o.state:
                return o.state
        raise KeyError(
            "not a tensor a shard of this sharded optimizer holds state for (its keys are "
            "the shards' tensors: iterate opt.state, or use state_dict() for the unsharded "
            "state)"
        )

    def __getitem__(self, key: Any) -> Any:
        return self._owner(key)[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._owner(key)[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._owner(key)[key]

    def __iter__(self) -> Any:
        return itertools.chain.from_iterable(o.state for o in self._optimizers)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)

    def clear(self) -> None:
        for o in self._optimizers:
            o.state.clear()

    def follow(self, opt: Any) -> None:
        """Before a step: `opt.state` replaced by an empty mapping (a reset)
        clears every shard's and becomes this view again; one with state in
        it cannot be cut into the shards."""
        if opt.state is self:
            return
        if len(opt.state):
            raise ValueError(
                "a sharded optimizer's state lives in its shards: opt.state was replaced by "
                "one holding state; load state with opt.load_state_dict(...) (an unsharded "
                "optimizer's state dict), or reset it with opt.state.clear()"
            )
        self.clear()
        opt.state = self


class _Chunks(NamedTuple):
    """One dtype's elements of the trained parameters, by slot: each slot's
    segments of that dtype in plan order (laid end to end: its chunk), and
    each chunk's length."""

    dtype: torch.dtype
    segments: List[List[Segment]]
    sizes: List[int]


def _chunks_by_dtype(
    plan: List[List[Piece]], order: List[int], params0: Sequence[torch.Tensor]
) -> List[_Chunks]:
    by_dtype: Dict[torch.dtype, List[List[Segment]]] = {}
    for s, pieces in enumerate(plan):
        for k, lo, hi in pieces:
            i = order[k]
            by_dtype.setdefault(params0[i].dtype, [[] for _ in plan])[s].append((i, lo, hi))
    return [
        _Chunks(dtype, segs, [sum(hi - lo for _, lo, hi in seg) for seg in segs])
        for dtype, segs in by_dtype.items()
    ]


def _views(
    params: Sequence[torch.Tensor], flat: torch.Tensor, segments: List[Segment], at: int
) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """(the parameters' elements, flat's elements from `at`) for `segments`
    laid end to end there: a whole parameter as itself (any layout, so
    channels_last too) and flat's part in its shape, a cut one as a flat
    view of its (contiguous) elements."""
    mine, there = [], []
    for i, lo, hi in segments:
        p, n = params[i], hi - lo
        if lo == 0 and hi == p.numel():
            mine.append(p)
            there.append(flat[at : at + n].view(p.shape))
        else:
            mine.append(p.view(-1)[lo:hi])
            there.append(flat[at : at + n])
        at += n
    return mine, there


class DeviceGather:
    """GPU replicas take the stepped elements they do not own, in one
    process or across processes alike: per dtype, one all-gather over every
    GPU of every process (the engine's NCCL communicator, or pyddp's kernel
    for replicas sharing one GPU), in place. Each replica's chunk is padded
    to the largest slot's, c elements, and written into its own block of a
    vector of slots x c; the collective fills the other blocks with their
    owners' values, bit for bit. A replica's slot is its rank among the
    collective's (`slot_of`), so the blocks come in slot order. Bytes moved:
    the parameters once (as torch's ZeroRedundancyOptimizer's broadcasts),
    plus the padding: under one element per slot for elementwise optimizers
    (equal ranges), up to the largest whole parameter's excess for others."""

    def __init__(
        self, reducer: GradientShards, plan: List[List[Piece]], order: List[int], slot_of: List[int]
    ):
        # Collectives outside the buckets on the engine's backend, on the
        # current streams.
        route = reducer.route()
        assert route is not None  # GPU replicas only
        self.route = route
        self.params = reducer.params
        self.slot_of = slot_of
        self.chunks = _chunks_by_dtype(plan, order, reducer.params[0])

    def __call__(self) -> None:
        with torch.no_grad():
            for dtype, segments, sizes in self.chunks:
                c, slots = max(sizes), len(sizes)
                if c == 0:
                    continue
                recvs = [self.route.zeros(slots * c, dtype, r) for r in range(len(self.params))]
                sends = []
                for r, (params, recv) in enumerate(zip(self.params, recvs)):
                    s = self.slot_of[r]
                    mine, there = _views(params, recv, segments[s], s * c)
                    if mine:  # whole parameters in any layout: copied by value
                        torch._foreach_copy_(there, mine)
                    sends.append(recv[s * c : (s + 1) * c])
                self.route.all_gather(sends, recvs)
                for r, (params, recv) in enumerate(zip(self.params, recvs)):
                    dst, src = [], []
                    for s in range(slots):
                        if s != self.slot_of[r]:
                            mine, there = _views(params, recv, segments[s], s * c)
                            dst += mine
                            src += there
                    if dst:
                        torch._foreach_copy_(dst, src)


class HostGather:
    """CPU replicas across processes take the elements other processes own:
    per dtype, one all-gather over torch.distributed of each process's
    chunks (its slots' end to end, as replica 0 holds them once it took its
    process's other replicas' pieces in memory), padded to the largest
    process's, as bytes: bit for bit."""

    def __init__(
        self, reducer: GradientShards, plan: List[List[Piece]], order: List[int], what: str
    ):
        ranks = reducer.ranks
        self.ranks, self.what, self.params0 = ranks, what, reducer.params[0]
        firsts = list(itertools.accumulate([0] + ranks.replicas_per_rank))
        self.mine = range(firsts[ranks.rank], firsts[ranks.rank + 1])
        self.others = [s for s in range(firsts[-1]) if s not in self.mine]
        # Per dtype: the chunks, each process's block length, and where each
        # slot's chunk starts in the gathered vector.
        self.plans: List[Tuple[_Chunks, int, List[int]]] = []
        for chunks in _chunks_by_dtype(plan, order, reducer.params[0]):
            spans = list(zip(firsts, firsts[1:]))
            block = max(sum(chunks.sizes[a:b]) for a, b in spans)
            starts = [0] * len(chunks.sizes)
            for p, (a, b) in enumerate(spans):
                at = p * block
                for slot in range(a, b):
                    starts[slot], at = at, at + chunks.sizes[slot]
            if block:
                self.plans.append((chunks, block, starts))

    def __call__(self) -> None:
        with torch.no_grad():
            for chunks, block, starts in self.plans:
                out = torch.zeros(block, dtype=chunks.dtype)
                base = self.ranks.rank * block
                self._copy(chunks, out, starts, self.mine, -base, into_params=False)
                flat = self.ranks.gather_tensor(out, self.what)
                self._copy(chunks, flat, starts, self.others, 0, into_params=True)

    def _copy(
        self,
        chunks: _Chunks,
        flat: torch.Tensor,
        starts: List[int],
        slots: Sequence[int],
        shift: int,
        into_params: bool,
    ) -> None:
        params_v, flat_v = [], []
        for s in slots:
            p, f = _views(self.params0, flat, chunks.segments[s], starts[s] + shift)
            params_v += p
            flat_v += f
        if params_v:
            if into_params:
                torch._foreach_copy_(params_v, flat_v)
            else:
                torch._foreach_copy_(flat_v, params_v)


def clip_sharded(
    reducer: GradientShards, max_norm: float, norm_type: float, strict: bool
) -> torch.Tensor:
    """dmodel.clip_grad_norm_ under shard='gradients': each replica holds
    the reduced gradient in its block of every bucket only, so the global
    norm combines every replica's (sharded_norm), and each replica scales
    its blocks. Returns the total norm (on replica 0's device)."""
    norm_type = checked_norm_type(norm_type)
    blocks, totals = sharded_norm(reducer, norm_type)
    # Summed in float64 (float32 over a large block was 7e-6 off: a review),
    # read in the gradients' dtype as torch's clip, which sums the powers of
    # 16- and 32-bit ones in float32: past its range the norm is infinite
    # there, and so here (past the gradients' own range too, by the cast).
    dtype = functools.reduce(torch.promote_types, [b.dtype for b in blocks[0]])
    if dtype != torch.float64 and norm_type != float("inf"):
        top = torch.finfo(torch.float32).max
        totals = [torch.where(t.pow(norm_type) > top, float("inf"), t) for t in totals]
    totals = [t.to(dtype) for t in totals]
    if strict:  # error_if_nonfinite (every replica holds the same total)
        refuse_nonfinite(totals[0], norm_type)
    with torch.no_grad():
        for own, total in zip(blocks, totals):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            torch._foreach_mul_(own, coef.to(own[0].dtype))
    return totals[0]


def sharded_finite(reducer: GradientShards) -> bool:
    """Under shard='gradients': whether every replica's blocks of every
    process are finite (fp16 loss scaling's overflow check; one replica's
    blocks alone would miss an overflow elsewhere). Every rank gets the
    same answer: the norms are all-gathered. Reads the host (GPUs wait)."""
    _, totals = sharded_norm(reducer, 2.0)
    return bool(torch.isfinite(totals[0]))


def sharded_norm(
    reducer: GradientShards, norm_type: float
) -> Tuple[List[List[torch.Tensor]], List[torch.Tensor]]:
    """Each replica's blocks of every bucket, and on each replica the
    global norm of the reduced gradient: each takes its blocks' norm, the
    partial norms of every replica of every process are all-gathered (on
    GPUs on the engine's backend, no host wait; across processes on CPUs
    through gloo) and combined, in float64 (a non-finite element makes the
    norm non-finite)."""
    ranks = reducer.scatter_ranks
    p = float(norm_type)
    blocks = reducer.blocks
    partials = []
    for own in blocks:
        norms = torch.stack(
            [torch.linalg.vector_norm(b, p, dtype=torch.float64) for b in own]
        )  # padding is zero: it adds nothing
        partials.append(norms.max() if p == float("inf") else norms.pow(p).sum())
    with torch.no_grad():
        route = reducer.route()
        if route is not None:
            sends = [route.zeros(1, torch.float64, r) for r in range(len(blocks))]
            recvs = [route.zeros(ranks, torch.float64, r) for r in range(len(blocks))]
            for s, part in zip(sends, partials):
                s.copy_(part.reshape(1))
            route.all_gather(sends, recvs)
            everyone = recvs
        else:
            mine = torch.stack(partials).reshape(-1)
            everyone = [reducer.ranks.gather_tensor(mine, CLIP_NORMS)] * len(blocks)
        totals = [
            parts.max() if p == float("inf") else parts.sum().pow(1.0 / p) for parts in everyone
        ]
    return blocks, totals
