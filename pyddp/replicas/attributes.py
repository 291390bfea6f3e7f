"""Plain attributes the user sets on the wrapped model after wrap
(`model.drop.p = 0.1`, `model.temperature = 2.0`, transformers'
`gradient_checkpointing = True` set by `gradient_checkpointing_enable()`):
each other replica is a deep copy made at wrap, so without this its modules
kept the old values and computed something else, in silence.

Followed, before each forward: an attribute of a module of replica 0 whose
value is a plain value (None, a bool, number, string, bytes, torch.dtype, an
enum member, or a tuple or frozenset of these), set, rebound or deleted
since the last forward, is set (or deleted) alike on every replica. Plain
values are immutable, so sharing one is exact. Not followed: other objects
(tensors, lists, configs; a module's own forward often rebinds those, an
auxiliary loss for instance, and each replica holds its own), changes
inside a mutable object (`model.config.use_cache = False`), and torch's own
module state (modes, hooks, parameters, buffers and submodules, which
mirror.py follows or refuses).

Cheap where nothing changed: two C-level passes (the modules' dict sizes,
the identity of every plain value) per forward."""

from __future__ import annotations

import enum
import operator
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import nn

_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, enum.Enum)
# torch's own module state: followed (or refused) by mirror.py.
_TORCH_KEYS = frozenset(nn.Module().__dict__)
_MISSING = object()


def plain(value: Any) -> bool:
    """An immutable value that every replica may share."""
    if isinstance(value, _SCALARS):
        return True
    if type(value) in (tuple, frozenset):
        return all(map(plain, value))
    return False


class Attributes:
    """Replica 0's plain attributes, followed on the other replicas. `modules`:
    each replica's modules, in the same order."""

    def __init__(self, modules: Sequence[Sequence[nn.Module]]):
        self.dicts: List[List[Dict[str, Any]]] = [[m.__dict__ for m in mods] for mods in modules]
        self._snapshot()

    def _snapshot(self) -> None:
        first = self.dicts[0]
        self.sizes = list(map(len, first))
        slots: List[Tuple[int, str]] = [
            (k, key)
            for k, d in enumerate(first)
            for key, value in d.items()
            if key not in _TORCH_KEYS and plain(value)
        ]
        self.slots = slots
        self.slot_dicts = [first[k] for k, _ in slots]
        self.slot_keys = [key for _, key in slots]
        self.values = list(map(dict.get, self.slot_dicts, self.slot_keys))

    def follow(self) -> bool:
        """Brings the other replicas' plain attributes in line with replica
        0's; returns whether any changed."""
        if list(map(len, self.dicts[0])) == self.sizes and all(
            map(operator.is_, map(dict.get, self.slot_dicts, self.slot_keys), self.values)
        ):
            return False
        before = dict(zip(self.slots, self.values))
        changed = False
        for k, d in enumerate(self.dicts[0]):
            for key, value in d.items():
                if key in _TORCH_KEYS or not plain(value):
                    continue
                if before.pop((k, key), _MISSING) is not value:
                    changed = True
                    for other in self.dicts[1:]:
                        other[k][key] = value
        for k, key in before:  # plain before, now deleted or no longer plain
            if key not in self.dicts[0][k]:
                changed = True
                for other in self.dicts[1:]:
                    other[k].pop(key, None)
        self._snapshot()
        return changed
