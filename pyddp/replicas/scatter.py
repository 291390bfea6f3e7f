"""Scatter and gather for the wrapped model: a batch (any tree of tensors,
containers, dataclasses, pytree nodes, model caches) split along dim 0 over
the replicas' devices, and the replicas' outputs combined into one batch
on devices[0], refusing what cannot be combined with a message that says why;
and the guard on sequence-first layers a batch split along dim 0 would cut."""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from ..engine.hooks import InertCopy
from .combine import InputCut, combine_column
from .tree import (
    caches,
    flatten,
    other_leaves,
    shard_sizes,
    structure,
    substitute,
    tensor_paths,
)

# (per-replica tensors, their kinds, shard weights) -> the combined tensors
CombineFn = Callable[[List[List[torch.Tensor]], List[str], List[float]], List[torch.Tensor]]


def scatter(
    tree: Any, devices: Sequence[torch.device], cut: bool = False, call: bool = False
) -> Tuple[List[Any], List[int], Optional[InputCut]]:
    """Splits every batched tensor in `tree` along dim 0 over `devices`
    (shard sizes as even as possible; a batch smaller than the number of
    devices uses the first `batch` ones) and moves each shard there. `cut`:
    shards that need a gradient become leaves of their own, returned as a
    combine.InputCut (None where no input needs a gradient). `call`: `tree`
    is a forward's (args, kwargs), whose count of items is shared (share_count)."""
    leaves, rebuild = flatten(tree)
    for t in leaves:
        if t.layout != torch.strided or t.is_nested:  # (an internal error in split before)
            kind = "a nested tensor" if t.is_nested else f"a {t.layout} tensor"
            raise ValueError(
                f"pyddp: an input is {kind}, which pyddp cannot split over replicas along "
                "dim 0; pass dense tensors (.to_dense(), or padded with a mask)"
            )
    batched = [t for t in leaves if t.dim() > 0]
    if not batched:
        raise ValueError(
            "the inputs hold no tensor with a batch dimension: nothing to split over replicas"
        )
    batch = batched[0].shape[0]
    if any(t.shape[0] != batch for t in batched):
        _refuse_batch_sizes(tree, leaves, batch, call)
    # A batch smaller than the number of replicas: only the first `batch`
    # replicas take part; the others contribute zeros to the reduction. An
    # empty one (a rank's tail of a dataset split by rank, which torch DDP
    # takes) runs on replica 0 alone, as on one device.
    sizes = shard_sizes(batch, max(1, min(batch, len(devices))))
    split = [[t] * len(sizes) if t.dim() == 0 else list(t.split(sizes)) for t in leaves]
    inputs = InputCut() if cut and any(t.requires_grad for t in leaves) else None

    def place(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        t = _to(t, device)
        return inputs.cut(t) if inputs is not None and t.requires_grad else t

    shards = [
        rebuild([place(parts[r], device) for parts in split])
        for r, device in enumerate(devices[: len(sizes)])
    ]
    if call and len(sizes) > 1 and tree[1].get(_COUNT) is not None:
        share_count(shards, sizes)
    return shards, sizes, inputs


_COUNT = "num_items_in_batch"


def _refuse_batch_sizes(tree: Any, leaves: List[torch.Tensor], batch: int, call: bool) -> None:
    """Tensors whose dim 0 differ, named by where they were given (`tree`:
    a forward's (args, kwargs), or dmodel.loss's (inputs, targets))."""
    roots = zip(tree, ("args", "kwargs") if call else ("inputs", "targets"))
    paths = [p for part, root in roots for p in tensor_paths(part, root)]
    sized = [(p, t.shape[0]) for p, t in zip(paths, leaves) if t.dim() > 0]
    first, other = sized[0], next(x for x in sized if x[1] != batch)
    # One row beside the batch (transformers' position_ids of shape (1, S)):
    # expanded, it splits as the batch does. (Not said of the first tensor,
    # which sets the batch: one example beside class weights is no broadcast.)
    broadcast = (
        f"; if {other[0]} is one row to broadcast over the batch, pass it expanded to every "
        f"row, .expand({first[1]}, ...) (a view, no copy)"
        if other[1] == 1 and first[1] > 1
        else ""
    )
    raise ValueError(
        f"input tensors disagree on the batch size (dim 0): {first[0]} has {first[1]} rows and "
        f"{other[0]} {other[1]}; pyddp splits every tensor argument along dim 0 over the "
        f"replicas{broadcast}. A tensor that is not one row per example (a mask over positions, "
        "class weights) goes to the model another way: set it on your model (an attribute or "
        "buffer set there reaches every replica) or build it in forward; pass a recurrent "
        "state batch first and transpose it inside forward"
    )


def share_count(shards: List[Any], sizes: List[int]) -> None:
    """transformers' `num_items_in_batch`: the whole batch's count of what a
    model's loss sums (the labels not masked), which the model divides its
    summed loss by. pyddp takes the shard-size-weighted mean of the replicas'
    0-dim outputs, so replica r is given the count times its share of the
    rows, N * n_r / n: the weighted mean of sum_r / (N n_r / n) is the sum
    over the shards over N, one device's loss (before, 1/n of it). A model
    that ignores the count returns its shard's mean, weighted as before, and
    so do other 0-dim outputs (a mixture of experts' auxiliary loss)."""
    total = sum(sizes)
    for (_, kwargs), n in zip(shards, sizes):
        kwargs[_COUNT] = kwargs[_COUNT] * (n / total)


def gather_call(
    call: Tuple[tuple, Dict[str, Any]],
    shards: List[Any],
    outs: List[Any],
    sizes: List[int],
    device: torch.device,
    combine: CombineFn,
    owner: Any,
) -> Any:
    """gather() for a forward of `owner` (the wrapped model) called with
    `call` (args, kwargs) whose replicas took `shards`; model caches passed
    in are refilled (refill_caches)."""
    warned = _WARNED.setdefault(owner, set())
    return refill_caches(call, shards, outs, gather(outs, sizes, device, combine, warned))


def gather(
    outs: List[Any],
    sizes: List[int],
    device: torch.device,
    combine: CombineFn,
    warned: Optional[Set[str]] = None,
) -> Any:
    """`warned`: the outputs already warned about as not batch-major (their
    paths; the wrapped model's, else none). Batch tensors are concatenated;
    0-dim floating tensors (a loss the model computes itself) become the
    shard-size-weighted mean; other 0-dim tensors are stacked, one per
    replica. Non-tensor values are refused unless every replica returned the
    same None, str or bytes. `combine` combines the columns that need a
    gradient (through autograd, see combine.py)."""
    weights = [n / sum(sizes) for n in sizes] if sum(sizes) else [1.0] * len(sizes)
    if all(isinstance(o, torch.Tensor) for o in outs):  # one tensor each: no tree to walk
        kind = _gather_kind(outs[0])
        _check_batch_major(outs, sizes, outs, 0, warned)
        if any(o.requires_grad for o in outs):
            return combine([[o] for o in outs], [kind], weights)[0]
        return combine_column(outs, kind, device, weights)
    shapes = [structure(o) for o in outs]
    for r, shape in enumerate(shapes[1:], start=1):
        if shape != shapes[0]:
            raise RuntimeError(
                f"pyddp: replicas 0 and {r} returned outputs of different structure "
                "(containers, keys, or which values are tensors), which cannot be combined "
                f"into one batch: {_short(shapes[0])} vs {_short(shape)}"
            )
    flat = [flatten(o) for o in outs]
    leaves = [f[0] for f in flat]
    rebuild = flat[0][1]
    _check_other_leaves(outs)
    results: List[Optional[torch.Tensor]] = [None] * len(leaves[0])
    kinds = [_gather_kind(t) for t in leaves[0]]
    differentiable = []
    for j in range(len(results)):
        column = [ls[j] for ls in leaves]
        _check_batch_major(column, sizes, outs, j, warned)
        if any(t.requires_grad for t in column):
            differentiable.append(j)
        else:
            results[j] = combine_column(column, kinds[j], device, weights)
    if differentiable:
        combined = combine(
            [[ls[j] for j in differentiable] for ls in leaves],
            [kinds[j] for j in differentiable],
            weights,
        )
        for j, t in zip(differentiable, combined):
            results[j] = t
    return rebuild(results)


def refill_caches(tree: Any, shards: List[Any], outs: List[Any], gathered: Any) -> Any:
    """A model cache passed in is filled in place and returned by the model
    (transformers' `DynamicCache`: `model(ids, past_key_values=cache)`): on
    one device the caller's object holds the prefix's keys and values
    afterwards. Each replica filled its own shard's copy (scatter), so the
    caller's object takes the state of the gathered cache that replica 0's
    copy became, and is the output's cache, as on one device (before, it
    stayed empty: the next token ran without the prefix, 0.25 off one
    device, silently). A copy a replica changed without returning it is
    refused. Returns `gathered`, the caller's caches in it."""
    mine = caches(tree)
    if not mine:
        return gathered
    returned: Dict[int, List[int]] = {}  # (a cache returned twice: each place)
    for k, c in enumerate(caches(outs[0])):
        returned.setdefault(id(c), []).append(k)
    joined = caches(gathered)  # (outs[0]'s structure: its caches in the same order)
    yours: Dict[int, Any] = {}
    for cache, copy in zip(mine, caches(shards[0])):
        places = returned.get(id(copy))
        if places:
            vars(cache).clear()
            vars(cache).update(vars(joined[places[0]]))  # (its tensors: the gathered batch's)
            yours.update((id(joined[k]), cache) for k in places)
        elif _changed(copy, cache):
            raise RuntimeError(
                f"pyddp: the model changed the {type(cache).__name__} passed to it in place "
                "and did not return it: each replica changed its own shard's copy, and "
                "pyddp joins only what the model returns, so your object would not hold "
                "the batch's state. Return it (transformers: use_cache=True), or call the "
                "unwrapped model (dmodel.module) for this"
            )
    return substitute(gathered, yours) if yours else gathered


def _changed(copy: Any, cache: Any) -> bool:
    """Whether a replica visibly changed its copy of `cache` in place: its
    structure, its tensors' shapes past the batch dimension, or its other
    values (a position counter). Values written into its tensors are not seen."""
    if structure(copy) != structure(cache):
        return True
    shapes = [[t.shape[1:] for t in flatten(c)[0]] for c in (copy, cache)]
    values = zip(other_leaves(copy), other_leaves(cache))
    return shapes[0] != shapes[1] or not all(_equal(a.value, b.value) for a, b in values)


def _check_batch_major(
    column: List[torch.Tensor], sizes: List[int], outs: Any, j: int, warned: Optional[Set[str]]
) -> None:
    """A column (output tensor `j`, one per replica) that is not batch-major:
    shapes past dim 0 that differ are refused (torch's size error before);
    as many rows on every replica however many rows of the batch each took
    (a statistic over the shard, a parameter: n times one device's rows,
    silently before) is warned about, once per output: a selection of rows
    (`x[mask]`) may take as many on each by chance, and joins right. Rows in
    proportion to the shares (a few per sample), or that vary, join as one
    device's."""
    if len(column) < 2 or column[0].dim() == 0:
        return
    if any(t.dim() == 1 and t.shape[0] == 0 for t in column):
        return  # (torch.cat passes over an empty 1-D tensor: a selection of none)
    shapes = [t.shape for t in column]
    rows, rest = [s[0] for s in shapes], shapes[0][1:]
    differ = any(s[1:] != rest for s in shapes)
    if rows == sizes and not differ:  # (a row per row of the batch: the common case)
        return
    rows0, share0 = rows[0], sizes[0]
    proportional = rows0 % share0 == 0 and all(r * share0 == rows0 * s for r, s in zip(rows, sizes))
    if not differ and (proportional or len(set(rows)) > 1 or rows0 == 0):
        return
    one = isinstance(outs[0], torch.Tensor)
    path = "the output" if one else tensor_paths(outs[0])[j]
    shapes = ", ".join(str(tuple(t.shape)) for t in column)
    said = f"pyddp: {path} has shapes {shapes} on the replicas"
    if differ:
        raise RuntimeError(
            f"{said}: past dim 0 they differ, so they cannot be joined along the batch (a "
            "tensor comparing a shard's rows with each other, such as an in-batch similarity "
            "or CLIP's logits_per_image, is each replica's own). Return only tensors whose dim "
            "0 is the batch, and compute such values from the gathered outputs"
        )
    warned = set() if warned is None else warned
    if path in warned:  # (once per output: warnings' own registry forgets, and shapes vary)
        return
    warned.add(path)
    warnings.warn(
        f"{said}, as many rows on each though they took {sizes} rows of the batch: if it is "
        "not batch-major (a statistic over the shard, a parameter), joining it along dim 0 "
        f"gives {len(column)} times one device's rows. Return only tensors whose dim 0 is the "
        "batch, and compute such values from the gathered outputs (said once per output)",
        stacklevel=_callers_level(),
    )


# Per wrapped model, the outputs warned about as not batch-major (their paths).
_WARNED: weakref.WeakKeyDictionary[Any, Set[str]] = weakref.WeakKeyDictionary()
# (with the separator: a user's file named pyddp_*.py beside the package is not one)
_LIBRARIES = tuple(
    os.path.dirname(path) + os.sep for path in (os.path.dirname(__file__), torch.__file__)
)


def _callers_level() -> int:
    """The stacklevel of the caller outside pyddp and torch (a warning names
    the user's line)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARIES):
        frame, level = frame.f_back, level + 1
    return level


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` (a shard already there, as on CPU replicas, as it is)."""
    return t if t.device == device else t.to(device, non_blocking=True)


def _short(shape: Any) -> str:
    text = repr(shape).replace("<class '", "").replace("'>", "")
    return text if len(text) < 200 else text[:200] + "..."


def _gather_kind(t: torch.Tensor) -> str:
    if t.dim() > 0:
        return "cat"
    return "mean" if t.is_floating_point() or t.is_complex() else "cat"


_SAME_ON_EVERY_REPLICA = (type(None), str, bytes)


def _check_other_leaves(outs: List[Any]) -> None:
    """One replica's non-tensor value is not the batch's: refuse it, unless it
    is a None, str or bytes equal on every replica (a constant), or describes
    a model cache (its dtype, device, flags) and is equal on every replica.
    With one replica its value is the batch's."""
    if len(outs) == 1:
        return
    per_replica = [other_leaves(o) for o in outs]
    for k, leaf in enumerate(per_replica[0]):
        values = [leaves[k].value for leaves in per_replica]  # same structure: checked first
        if leaf.in_cache and isinstance(leaf.value, torch.device):
            continue  # each replica's cache names its own device; replica 0's is devices[0]
        if (leaf.in_cache or isinstance(leaf.value, _SAME_ON_EVERY_REPLICA)) and all(
            _equal(v, leaf.value) for v in values
        ):
            continue
        raise TypeError(_uncombinable(leaf, values))


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - == that does not give one bool: not a constant
        return False


def _uncombinable(leaf: Any, values: List[Any]) -> str:
    kind = type(leaf.value)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    shown = ", ".join(_brief(v) for v in values)
    return (
        f"pyddp: cannot join the replicas' outputs: {leaf.path} is of type {name} (one per "
        f"replica: {shown}). Each replica computed it on its own shard of the batch, so no "
        "replica's value is the batch's, and pyddp cannot see tensors inside it to join "
        "them. Remedies: return tensors instead (batch tensors are concatenated along dim "
        "0, 0-dim floating tensors such as a loss become the shard-size-weighted mean); "
        "leave the value out of the output (for a transformers model, use_cache=False "
        "drops past_key_values); or register its type with "
        "torch.utils._pytree.register_pytree_node so pyddp can join the tensors it holds."
    )


def _brief(value: Any) -> str:
    """A short, complete description: a scalar's repr, else only the type."""
    if isinstance(value, (bool, int, float, complex, type(None))):
        return repr(value)
    if isinstance(value, (str, bytes)) and len(value) <= 40:
        return repr(value)
    return f"<{type(value).__name__}>"


def call_arguments(inputs: Any) -> Tuple[tuple, Dict[str, Any]]:
    """The model's call arguments from `inputs`: a tuple (positional), a dict
    (keywords) or one argument."""
    if isinstance(inputs, tuple) and not hasattr(inputs, "_fields"):
        return inputs, {}
    if isinstance(inputs, Mapping):
        if not all(isinstance(k, str) for k in inputs):
            raise TypeError("a dict of inputs is taken as keyword arguments: its keys must be str")
        return (), dict(inputs)
    return (inputs,), {}


def batch_size(args: Any) -> int:
    for t in flatten(args)[0]:
        if t.dim() > 0:
            return t.shape[0]
    raise ValueError("a shard holds no tensor with a batch dimension")


# Layers whose input is (sequence, batch, ...) unless batch_first=True.
_SEQUENCE_FIRST = (
    torch.nn.RNNBase,
    torch.nn.MultiheadAttention,
    torch.nn.TransformerEncoderLayer,
    torch.nn.TransformerDecoderLayer,
)


def guard_sequence_first(replicas: Sequence[Any], workers: Any) -> List[Any]:
    """Hooks on every replica's sequence-first layers (batch_first=False),
    which read the running forward's shares of the batch (`workers.shard_rows`,
    set by ReplicaWorkers.run); their handles."""
    return [
        m.register_forward_pre_hook(_SequenceFirstGuard(workers, r, name))
        for r, replica in enumerate(replicas)
        for name, m in replica.named_modules()
        if isinstance(m, _SEQUENCE_FIRST) and getattr(m, "batch_first", True) is False
    ]


class _SequenceFirstGuard(InertCopy):
    """A forward pre-hook on replica r's sequence-first layer: where its
    input's dim 0 is the share of the batch pyddp gave replica r (split
    along dim 0) and its dim 1 is not, the batch was the sequence: each
    replica would run a piece of every sequence (0.2 to 0.4 off one device,
    silently, before). Refused, with the remedy. Holds the workers weakly."""

    def __init__(self, workers: Any, r: int, name: str) -> None:
        self.owner, self.r, self.name = weakref.ref(workers), r, name

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        workers = self.owner()
        rows = None if workers is None else workers.shard_rows
        x = args[0] if args else None
        if rows is None or len(rows) < 2 or not isinstance(x, torch.Tensor) or x.dim() != 3:
            return
        share = rows[self.r]
        if x.shape[0] == share and x.shape[1] != share:
            raise RuntimeError(
                f"pyddp: {type(module).__name__} {self.name or '(the model)'!r} has "
                f"batch_first=False, so it reads its input {tuple(x.shape)} as (sequence, "
                f"batch, ...), but its dim 0 is this replica's share of the batch pyddp split "
                f"along dim 0 ({share} of {sum(rows)} rows) and its dim 1 is not: the inputs "
                "look sequence-first, and each replica would run a piece of every sequence. "
                "Pass inputs batch first (batch, sequence, ...) and transpose inside forward, "
                "or build the layer with batch_first=True (pyddp splits dim 0 only)"
            )
