"""Plain attributes the user sets on the wrapped model after wrap
(`model.drop.p = 0.1`, `model.temperature = 2.0`, transformers'
`gradient_checkpointing = True` with its `_gradient_checkpointing_func`):
each other replica is a deep copy made at wrap, so without this its modules
kept the old values and computed something else, in silence.

Followed, before each forward: an attribute of a module of replica 0 set,
rebound or deleted since the last forward on replica 0 alone, whose value
is plain (whatever it held before): None, a bool, number (numpy's scalars
too), string, bytes, torch.dtype, an enum member,
a function (not a bound method: that would run on replica 0's module), a
functools.partial of plain parts, or a tuple or frozenset of these. Plain
values are immutable, so sharing one is exact. An attribute that changed on
the other replicas too is left as each has it: their own forwards set it
(a cached row count, which uneven shards make differ). Not followed: other
objects (tensors, lists, configs; a module's own forward often rebinds
those, an auxiliary loss for instance), changes inside a mutable object
(transformers' configs are shared by the replicas instead: shared_at_copy),
and torch's own module state (modes,
hooks, parameters, buffers and submodules, which mirror.py follows or
refuses).

Cheap where nothing changed: two C-level passes (the modules' dict sizes,
the identity of every attribute value of replica 0) per forward.

Also Storages: which parameters got new storage since (mirror.py, watch.py)."""

from __future__ import annotations

import enum
import functools
import operator
import types
from typing import Any, Dict, List, Sequence, Set, Tuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, enum.Enum)
_PLAIN += (types.FunctionType,)  # not bound methods
try:
    import numpy

    _PLAIN += (numpy.generic,)  # numpy's scalars (np.float32(3.0)), not its arrays
except ImportError:  # pragma: no cover (torch without numpy)
    pass
# torch's own module state: followed (or refused) by mirror.py.
_TORCH_KEYS = frozenset(nn.Module().__dict__)
_MISSING = object()


def plain(value: Any) -> bool:
    """An immutable value that every replica may share."""
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, types.BuiltinFunctionType):  # torch.relu, not a tensor's add
        return isinstance(value.__self__, (types.ModuleType, type(None)))
    if type(value) in (tuple, frozenset):
        return all(map(plain, value))
    if type(value) is functools.partial:
        return plain(value.func) and plain(value.args) and all(map(plain, value.keywords.values()))
    return False


class Attributes:
    """Replica 0's plain attributes, followed on the other replicas. `modules`:
    each replica's modules, in the same order."""

    def __init__(self, modules: Sequence[Sequence[nn.Module]]):
        self.modules = [list(mods) for mods in modules]
        self._index = {id(m): j for j, m in enumerate(self.modules[0])}  # replica 0's
        self.dicts: List[List[Dict[str, Any]]] = [[m.__dict__ for m in mods] for mods in modules]
        self._slots()

    def _slots(self) -> None:
        """Replica 0's (module, name) attribute slots now (a tensor there may
        be rebound to a plain value), and every replica's value in them."""
        first = self.dicts[0]
        self.sizes = list(map(len, first))
        self.slots: List[Tuple[int, str]] = [
            (k, key) for k, d in enumerate(first) for key in d if key not in _TORCH_KEYS
        ]
        self.keys = [key for _, key in self.slots]
        self.slot_dicts = [[dicts[k] for k, _ in self.slots] for dicts in self.dicts]
        self._values()

    def _values(self) -> None:
        self.values = [list(map(dict.get, ds, self.keys)) for ds in self.slot_dicts]

    def follow(self) -> bool:
        """Brings the other replicas' plain attributes in line with replica
        0's where replica 0's alone changed; returns whether any was set."""
        now = list(map(dict.get, self.slot_dicts[0], self.keys))
        resized = list(map(len, self.dicts[0])) != self.sizes
        if not resized and all(map(operator.is_, now, self.values[0])):
            return False
        changed = False
        for i in [i for i, (a, b) in enumerate(zip(now, self.values[0])) if a is not b]:
            k, key = self.slots[i]
            value = self.dicts[0][k].get(key, _MISSING)
            for r in range(1, len(self.dicts)):
                other = self.dicts[r][k]
                if other.get(key, _MISSING) is not _was(self.values[r][i], other, key):
                    continue  # changed there too: that replica's own forward set it
                mine = value if value is _MISSING else self._for(value, r, k, key)
                if mine is _MISSING and value is not _MISSING:
                    break  # not followed
                changed = True
                if value is _MISSING:
                    other.pop(key, None)
                else:
                    other[key] = mine
        if resized:
            changed |= self._added()
            self._slots()
        else:
            self._values()
        return changed

    def _added(self) -> bool:
        """Plain attributes replica 0 gained since the last look: set on the
        replicas that lack them (those that have them set them themselves)."""
        known = set(self.slots)
        changed = False
        for k, d in enumerate(self.dicts[0]):
            for key, value in d.items():
                if (k, key) in known or key in _TORCH_KEYS:
                    continue
                for r in range(1, len(self.dicts)):
                    if key in self.dicts[r][k]:
                        continue  # set there too: by that replica's own forward
                    mine = self._for(value, r, k, key)
                    if mine is _MISSING:
                        break  # not followed
                    self.dicts[r][k][key] = mine
                    changed = True
        return changed

    def _for(self, value: Any, r: int, k: int, key: str) -> Any:
        """Replica r's counterpart of replica 0's `value` in module k's
        `key`, or _MISSING where it is not followed: a plain value itself; a
        method bound to one of replica 0's modules (`m.fc.forward =
        MethodType(f, m.fc)`), bound to replica r's module there. A function
        capturing one of replica 0's modules or their methods (a closure over
        the old forward) is refused: every replica would run replica 0's."""
        if isinstance(value, types.MethodType):
            j = self._index.get(id(value.__self__))
            return _MISSING if j is None else types.MethodType(value.__func__, self.modules[r][j])
        if not plain(value):
            return _MISSING
        for cell in value.__closure__ or () if isinstance(value, types.FunctionType) else ():
            try:
                held = cell.cell_contents
            except ValueError:  # (an empty cell)
                continue
            owner = held.__self__ if isinstance(held, types.MethodType) else held
            if id(owner) in self._index:
                raise RuntimeError(
                    f"pyddp: {type(self.modules[0][k]).__name__}.{key} was set after wrap to "
                    f"a function that captures the wrapped model's {type(owner).__name__} "
                    "(a closure over its forward?): every replica would run that one module "
                    "of replica 0. Bind a function as a method instead (types.MethodType(f, "
                    "module): followed on each replica's own module), or set it before wrap"
                )
        return value


def _was(value: Any, d: Dict[str, Any], key: str) -> Any:
    """A slot's recorded value as `get(key, _MISSING)` reads it (None where
    the key was absent reads as missing when it still is)."""
    return _MISSING if value is None and key not in d else value


_CONFIGS = ("PreTrainedConfig", "PretrainedConfig")  # (transformers 5's name, 4's)


def shared_at_copy(model: Any) -> Dict[int, Any]:
    """deepcopy's memo for a replica of `model`: objects every replica
    shares instead of copying. transformers' configs (no tensors; read at
    every forward: `model.config.pad_token_id = 7` after wrap changed
    replica 0's loss alone, 0.34 off one device's gradient in a probe)."""
    return {
        id(v): v
        for m in model.modules()
        for v in vars(m).values()
        if any(c.__name__ in _CONFIGS for c in type(v).__mro__)
    }


_data_ptr = operator.methodcaller("data_ptr")
_expired = torch.UntypedStorage._expired


class Storages:
    """Which of `params` got new storage since this was made (`.data =`, Module._apply:
    `.half().float()`). Pointers alone miss a new storage at its predecessor's freed
    address (seen in CI after `.double().float()`); a weak reference to each storage
    sees it die, keeping its bookkeeping, not its memory. Two C-level passes per look."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)
        self.ptrs = list(map(_data_ptr, self.params))
        self.refs = [StorageWeakRef(p.untyped_storage()) for p in self.params]
        self.cdata = [ref.cdata for ref in self.refs]

    def moved(self) -> List[int]:
        """Indices of the parameters whose storage changed (none: [])."""
        ptrs = list(map(_data_ptr, self.params))
        if ptrs == self.ptrs and not any(map(_expired, self.cdata)):
            return []
        dead = map(_expired, self.cdata)
        return [k for k, (a, b, d) in enumerate(zip(ptrs, self.ptrs, dead)) if a != b or d]

    def moved_ids(self) -> Set[int]:
        return {id(self.params[k]) for k in self.moved()}  # (empty: no Python loop)
