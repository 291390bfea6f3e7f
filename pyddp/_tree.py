"""Flatten nested inputs/outputs (tuples, lists, namedtuples, dicts, dataclasses)
into tensor leaves and rebuild them: what scatter and gather walk over."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, List, Tuple

import torch

Rebuild = Callable[[List[Any]], Any]


def flatten(obj: Any) -> Tuple[List[torch.Tensor], Rebuild]:
    """Returns the tensors in `obj` (depth first) and a function that rebuilds
    `obj` with those tensors replaced by the given list, in the same order."""
    leaves: List[torch.Tensor] = []
    rebuild = _flatten(obj, leaves)
    return leaves, lambda new: rebuild(iter(new))


def _flatten(obj: Any, leaves: List[torch.Tensor]) -> Callable[[Any], Any]:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return lambda it: next(it)
    if isinstance(obj, (list, tuple)):
        parts = [_flatten(x, leaves) for x in obj]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
            return lambda it: type(obj)(*[p(it) for p in parts])
        return lambda it: type(obj)([p(it) for p in parts])
    if isinstance(obj, Mapping):
        keys = list(obj.keys())
        parts = [_flatten(obj[k], leaves) for k in keys]

        def rebuild_mapping(it: Any) -> Any:
            values = {k: p(it) for k, p in zip(keys, parts)}
            if type(obj) is dict:
                return values
            try:
                return type(obj)(values)
            except TypeError:
                # A constructor that takes something else (defaultdict's
                # factory, keywords only): a copy of the original, refilled,
                # keeps the type and its extra state.
                new = copy.copy(obj)
                for k, v in values.items():
                    new[k] = v
                return new

        return rebuild_mapping
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        parts = [_flatten(getattr(obj, name), leaves) for name in fields]
        return lambda it: dataclasses.replace(obj, **{n: p(it) for n, p in zip(fields, parts)})
    return lambda it: obj  # non-tensors are replicated as they are


def structure(obj: Any) -> Any:
    """A comparable description of `obj`'s containers, keys and which leaves
    are tensors: replicas' outputs must agree on it to be joined."""
    if isinstance(obj, torch.Tensor):
        return "tensor"
    if isinstance(obj, (list, tuple)):
        return type(obj), tuple(structure(x) for x in obj)
    if isinstance(obj, Mapping):
        return type(obj), tuple((k, structure(x)) for k, x in obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        return type(obj), tuple((n, structure(getattr(obj, n))) for n in fields)
    return "value"


def other_leaves(obj: Any, path: str = "output") -> List[Tuple[str, Any]]:
    """The non-tensor leaves of `obj` with their paths (e.g. "output[1]['n']"),
    walking the same containers as `flatten`."""
    if isinstance(obj, torch.Tensor):
        return []
    if isinstance(obj, (list, tuple)):
        return [leaf for k, x in enumerate(obj) for leaf in other_leaves(x, f"{path}[{k}]")]
    if isinstance(obj, Mapping):
        return [leaf for k, x in obj.items() for leaf in other_leaves(x, f"{path}[{k!r}]")]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [
            leaf
            for f in dataclasses.fields(obj)
            if f.init
            for leaf in other_leaves(getattr(obj, f.name), f"{path}.{f.name}")
        ]
    return [(path, obj)]


def shard_sizes(batch: int, parts: int) -> List[int]:
    """Splits `batch` rows over `parts` shards as evenly as possible, larger first."""
    base, extra = divmod(batch, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]
