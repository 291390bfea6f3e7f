"""One replica in a process of several (torchrun's usual layout): there is no
other replica to copy to, but a parameter that trains without being reduced
would leave the processes apart in silence (as torch DDP leaves them). Before
every training forward, what pyddp reduces is checked against what the model
trains: a parameter that requires grad and is not one of wrap time's (frozen
then unfrozen; in a submodule added or replaced since) raises, as does a
reduced parameter given another dtype, device or shape. Everything else is the
model's own business with one replica: hooks, buffers, submodules without
parameters, modes, parametrizations and pruning (which move a parameter
under a new name, the same object), and evaluation in another dtype.

Cheap where nothing changed (C-level passes over the modules' parameter and
submodule dicts); a walk over the parameters only after a change."""

from __future__ import annotations

import operator
from itertools import chain
from typing import List, Sequence

from torch import nn

from .attributes import Storages
from .mirror import _REWRAP, unfrozen

_DICTS = operator.attrgetter("_parameters", "_modules")
_requires_grad = operator.attrgetter("requires_grad")


class OneReplicaWatch:
    def __init__(self, model: nn.Module, reduced: Sequence[nn.Parameter]):
        self.model = model
        self.reduced = list(reduced)
        self.ids = set(map(id, self.reduced))
        self.meta = [(p.dtype, p.device, p.shape) for p in self.reduced]
        self.storage = Storages(self.reduced)
        self._snapshot()
        # The parameters of wrap time that are not reduced (frozen then).
        self.frozen_at_wrap = set(map(id, self.unreduced))

    def _snapshot(self) -> None:
        """The model's structure now: what the fast check compares against."""
        modules = list(self.model.modules())
        self.dicts = [d for m in modules for d in _DICTS(m)]
        self.sizes = list(map(len, self.dicts))
        self.members = self._members(modules)
        self.params = list(self.model.named_parameters())
        self.unreduced: List[nn.Parameter] = [p for _, p in self.params if id(p) not in self.ids]
        self.modules = modules

    @staticmethod
    def _members(modules: Sequence[nn.Module]) -> List[object]:
        """Every parameter and child module, by identity."""
        return list(
            chain.from_iterable(map(dict.values, chain.from_iterable(map(_DICTS, modules))))
        )

    def follow(self) -> bool:
        """Before a training forward: raises if a parameter would train
        without being reduced. Returns whether the reduced parameters got new
        storage (the caller re-attaches their gradients)."""
        if list(map(len, self.dicts)) != self.sizes or not all(
            map(operator.is_, self._members(self.modules), self.members)
        ):
            self._snapshot()  # added, removed or replaced: judged below, parameter by parameter
        if any(map(_requires_grad, self.unreduced)):
            self._raise_unreduced()
        if not self.storage.moved():
            return False
        for p, (dtype, device, shape) in zip(self.reduced, self.meta):
            if p.dtype != dtype or p.device != device or p.shape != shape:
                name = next((n for n, q in self.params if q is p), "(no longer in the model)")
                raise RuntimeError(
                    f"pyddp: parameter {name!r} of the wrapped model changed from {dtype} "
                    f"{tuple(shape)} on {device} to {p.dtype} {tuple(p.shape)} on {p.device} "
                    "after wrap, and it is being trained; pyddp's buckets hold it as it was: "
                    f"{_REWRAP} (evaluating in another dtype under torch.no_grad() is fine)"
                )
        self.storage = Storages(self.reduced)
        return True

    def _raise_unreduced(self) -> None:
        for name, p in self.params:
            if id(p) in self.ids or not p.requires_grad:
                continue
            if id(p) in self.frozen_at_wrap:
                raise RuntimeError(unfrozen(name, p, "processes"))
            raise RuntimeError(
                f"pyddp: parameter {name!r} was added to the wrapped model after wrap (a "
                "submodule added or replaced, register_parameter, a parameter assigned) and "
                "requires grad; pyddp reduces the parameters of wrap time, so its gradient "
                f"would stay this process's own and the processes would diverge: {_REWRAP}"
            )
