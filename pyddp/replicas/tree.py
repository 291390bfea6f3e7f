"""Walk nested inputs/outputs down to their tensor leaves and rebuild them: what
scatter and gather walk over. One walker (`_node`) serves flattening, the
structure check and the non-tensor leaves, so the three always agree.

Containers it opens, in this order:
- tuples, lists, namedtuples, mappings (dicts, transformers' `ModelOutput`),
  dataclasses;
- any type registered with torch's pytree (`torch.utils._pytree`), through
  its own flatten/unflatten functions;
- model caches (transformers' `Cache` classes and any class named `...Cache`,
  the rule transformers itself uses to register them for torch.export): their
  attributes, recursively. A cache holds batch-major tensors (keys and values,
  `[batch, heads, seq, dim]`), so it splits and joins along dim 0 like any
  output; its other attributes describe the cache, not a shard.
Anything else is a leaf."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch.utils import _pytree

Rebuild = Callable[[List[Any]], Any]


class _Node(NamedTuple):
    keys: List[str]  # path suffixes of the children, e.g. "[0]", "['loss']", ".layers"
    children: List[Any]
    rebuild: Callable[[List[Any]], Any]  # the same container around new children
    kind: Any  # comparable: type and keys, for the structure check
    in_cache: bool = False  # its children belong to a model cache


def _node(obj: Any, in_cache: bool = False) -> Optional[_Node]:
    """How to open `obj`, or None for a leaf. `in_cache`: `obj` is reached
    from a model cache, whose plain objects (its layers) are opened too; the
    node passes that on to its children."""
    node = _open(obj, in_cache)
    return node._replace(in_cache=True) if node is not None and in_cache else node


def _open(obj: Any, in_cache: bool) -> Optional[_Node]:
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, (list, tuple)):
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple

            def rebuild(new: List[Any]) -> Any:
                return type(obj)(*new)
        else:

            def rebuild(new: List[Any]) -> Any:
                return type(obj)(new)

        return _Node([f"[{k}]" for k in range(len(obj))], list(obj), rebuild, (type(obj), len(obj)))
    if isinstance(obj, Mapping):
        keys = list(obj.keys())
        return _Node(
            [f"[{k!r}]" for k in keys],
            [obj[k] for k in keys],
            lambda new: _rebuild_mapping(obj, dict(zip(keys, new))),
            (type(obj), tuple(keys)),
        )
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = [f.name for f in dataclasses.fields(obj) if f.init]
        return _Node(
            [f".{n}" for n in names],
            [getattr(obj, n) for n in names],
            lambda new: dataclasses.replace(obj, **dict(zip(names, new))),
            (type(obj), tuple(names)),
        )
    registered = _pytree.SUPPORTED_NODES.get(type(obj))
    if registered is not None:
        children, context = registered.flatten_fn(obj)
        return _Node(
            [f"<{k}>" for k in range(len(children))],
            list(children),
            lambda new: registered.unflatten_fn(new, context),
            (type(obj), len(children), _comparable(context)),
        )
    if (in_cache or is_cache(obj)) and hasattr(obj, "__dict__") and not isinstance(obj, type):
        names = list(vars(obj))

        def rebuild_object(new: List[Any]) -> Any:
            fresh = copy.copy(obj)  # keeps the class and anything outside __dict__
            for n, v in zip(names, new):
                setattr(fresh, n, v)
            return fresh

        return _Node(
            [f".{n}" for n in names],
            [getattr(obj, n) for n in names],
            rebuild_object,
            (type(obj), tuple(names)),
            in_cache=True,
        )
    return None


def is_cache(obj: Any) -> bool:
    """A model's key/value cache: transformers' `Cache` and its subclasses, or
    any class whose name ends in `Cache` (transformers' own rule)."""
    return any(
        c.__name__ == "Cache" and c.__module__.startswith("transformers") for c in type(obj).__mro__
    ) or type(obj).__name__.endswith("Cache")


def _rebuild_mapping(obj: Mapping, values: dict) -> Any:
    if type(obj) is dict:
        return values
    try:
        return type(obj)(values)
    except TypeError:
        # A constructor that takes something else (defaultdict's factory,
        # keywords only): a copy of the original, refilled, keeps the type
        # and its extra state.
        new = copy.copy(obj)
        for k, v in values.items():
            new[k] = v
        return new


def _comparable(context: Any) -> Any:
    """A pytree context as something `==` can compare without raising."""
    try:
        bool(context == context)
        return context
    except Exception:  # an array-like context: == is elementwise or raises
        return repr(context)


def flatten(obj: Any) -> Tuple[List[torch.Tensor], Rebuild]:
    """Returns the tensors in `obj` (depth first) and a function that rebuilds
    `obj` with those tensors replaced by the given list, in the same order."""
    leaves: List[torch.Tensor] = []
    rebuild = _flatten(obj, leaves, False)
    return leaves, lambda new: rebuild(iter(new))


def _flatten(obj: Any, leaves: List[torch.Tensor], in_cache: bool) -> Callable[[Any], Any]:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return lambda it: next(it)
    kind = type(obj)
    if kind is tuple or kind is list or kind is dict:
        # The plain containers of every call's (args, kwargs), opened as
        # _open opens them, without building its keys (paths) on every step.
        keys = list(obj) if kind is dict else None
        items = [obj[k] for k in keys] if keys is not None else obj
        parts = [_flatten(c, leaves, in_cache) for c in items]
        if keys is not None:
            return lambda it: dict(zip(keys, [p(it) for p in parts]))
        return lambda it: kind([p(it) for p in parts])
    node = _node(obj, in_cache)
    if node is None:
        return lambda it: obj  # non-tensors are kept as they are
    parts = [_flatten(c, leaves, node.in_cache) for c in node.children]
    return lambda it: node.rebuild([p(it) for p in parts])


def structure(obj: Any, in_cache: bool = False) -> Any:
    """A comparable description of `obj`'s containers, keys and which leaves
    are tensors: replicas' outputs must agree on it to be joined."""
    if isinstance(obj, torch.Tensor):
        return "tensor"
    node = _node(obj, in_cache)
    if node is None:
        return "value"
    return node.kind, tuple(structure(c, node.in_cache) for c in node.children)


def caches(obj: Any) -> List[Any]:
    """The model caches in `obj` (the outermost: not those inside a cache),
    depth first: trees of one structure list theirs in the same order."""
    kind = type(obj)
    if kind is tuple or kind is list:  # (every call's args and kwargs: quickly)
        return [c for child in obj for c in caches(child)]
    if kind is dict:
        return [c for child in obj.values() for c in caches(child)]
    if isinstance(obj, torch.Tensor):
        return []
    if is_cache(obj) and hasattr(obj, "__dict__") and not isinstance(obj, type):
        return [obj]
    node = _node(obj)
    return [] if node is None else [c for child in node.children for c in caches(child)]


def substitute(obj: Any, objects: Dict[int, Any]) -> Any:
    """`obj` with each object whose id is a key of `objects` replaced by its
    value (the containers around it rebuilt; a cache is not opened)."""
    if id(obj) in objects:
        return objects[id(obj)]
    if isinstance(obj, torch.Tensor) or is_cache(obj):
        return obj
    node = _node(obj)
    if node is None:
        return obj
    children = [substitute(c, objects) for c in node.children]
    if all(a is b for a, b in zip(children, node.children)):
        return obj
    return node.rebuild(children)


class OtherLeaf(NamedTuple):
    path: str  # e.g. "output[1]['n']"
    value: Any
    in_cache: bool  # part of a model cache's description, not a value computed on a shard


def other_leaves(obj: Any, path: str = "output", in_cache: bool = False) -> List[OtherLeaf]:
    """The non-tensor leaves of `obj` with their paths, walking the same
    containers as `flatten`."""
    if isinstance(obj, torch.Tensor):
        return []
    node = _node(obj, in_cache)
    if node is None:
        return [OtherLeaf(path, obj, in_cache)]
    return [
        leaf
        for key, child in zip(node.keys, node.children)
        for leaf in other_leaves(child, path + key, node.in_cache)
    ]


def tensor_paths(obj: Any, path: str = "output", in_cache: bool = False) -> List[str]:
    """The paths of the tensor leaves of `obj`, in `flatten`'s order."""
    if isinstance(obj, torch.Tensor):
        return [path]
    node = _node(obj, in_cache)
    if node is None:
        return []
    return [
        p
        for key, child in zip(node.keys, node.children)
        for p in tensor_paths(child, path + key, node.in_cache)
    ]


def shard_sizes(batch: int, parts: int) -> List[int]:
    """Splits `batch` rows over `parts` shards as evenly as possible, larger first."""
    base, extra = divmod(batch, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]
