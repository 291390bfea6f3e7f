"""Keeps the replicas following replica 0, which is the user's own model object:
whatever the user does to it after `wrap` must reach the other replicas or stop
the next forward with an error that names it. Checked before every forward, in
O(modules + parameters) attribute reads:

- train/eval modes and `requires_grad` are copied to the other replicas;
- a parameter changed in place on one replica only (`model.load_state_dict`,
  an optimizer over `model.parameters()`, a manual edit) is seen through the
  tensors' version counters, which the replicated optimizer and
  `dmodel.load_state_dict` advance in step on every replica, and replica 0's
  value is copied to the others;
- what cannot follow (a module or parameter added, removed or replaced, a new
  dtype, device or shape, unfreezing a parameter frozen at wrap time) raises."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

_REWRAP = "dmodel.close() and wrap the model again (or make the change before wrapping)"


class ReplicaMirror:
    def __init__(self, replicas: Sequence[nn.Module], synced: Sequence[str]):
        self.modules: List[List[nn.Module]] = [list(m.modules()) for m in replicas]
        self.module_names = [n or "(the model)" for n, _ in replicas[0].named_modules()]
        self.layout = [_layout(m) for m in self.modules[0]]
        # Every parameter slot (module, local name) of replica 0, frozen ones included.
        self.slots: List[Tuple[int, str, nn.Parameter]] = [
            (j, name, p)
            for j, m in enumerate(self.modules[0])
            for name, p in m._parameters.items()
            if p is not None
        ]
        named = [dict(m.named_parameters()) for m in replicas]
        self.names = list(named[0])
        self.params: List[List[nn.Parameter]] = [[d[n] for n in self.names] for d in named]
        self.meta = [(p.dtype, p.device, p.shape) for p in self.params[0]]
        self.synced = set(synced)
        self.versions: List[List[int]] = [[p._version for p in ps] for ps in self.params]

    def follow(self) -> None:
        """Before a forward: brings replicas > 0 in line with replica 0, or raises."""
        self._check_structure()
        flags = [m.training for m in self.modules[0]]
        for mods in self.modules[1:]:
            for m, flag in zip(mods, flags):
                m.training = flag
        first = self.params[0]
        drifted: Dict[int, None] = {}
        for k, (p, name, (dtype, device, shape)) in enumerate(zip(first, self.names, self.meta)):
            if p.dtype != dtype or p.device != device or p.shape != shape:
                raise RuntimeError(
                    f"pyddp: parameter {name!r} of the wrapped model changed from {dtype} "
                    f"{tuple(shape)} on {device} to {p.dtype} {tuple(p.shape)} on {p.device} "
                    f"after wrap; the other replicas cannot follow: {_REWRAP}"
                )
            wants = p.requires_grad
            if wants and name not in self.synced:
                raise RuntimeError(
                    f"pyddp: parameter {name!r} was frozen when the model was wrapped and now "
                    "requires grad; its gradient is not reduced, so the replicas would "
                    f"diverge: {_REWRAP}. Freezing after wrap is followed."
                )
            for ps in self.params[1:]:
                if ps[k].requires_grad is not wants:
                    ps[k].requires_grad_(wants)
        for r, ps in enumerate(self.params):
            seen = self.versions[r]
            base = self.versions[0]
            for k, p in enumerate(ps):
                if p._version - seen[k] != first[k]._version - base[k]:
                    drifted[k] = None
        if drifted:
            with torch.no_grad():
                for k in drifted:
                    for ps in self.params[1:]:
                        ps[k].copy_(first[k])
        self.versions = [[p._version for p in ps] for ps in self.params]

    def _check_structure(self) -> None:
        for j, m in enumerate(self.modules[0]):
            if _layout(m) != self.layout[j]:
                raise RuntimeError(
                    f"pyddp: the wrapped model's module {self.module_names[j]!r} gained or lost "
                    "submodules, parameters or buffers after wrap (add_module, "
                    f"register_parameter, ...); the other replicas cannot follow: {_REWRAP}"
                )
        for j, name, p in self.slots:
            if self.modules[0][j]._parameters.get(name) is not p:
                where = self.module_names[j]
                raise RuntimeError(
                    f"pyddp: parameter {name!r} of module {where!r} was replaced after wrap; "
                    f"the other replicas cannot follow: {_REWRAP} (to change values, assign in "
                    "place, e.g. with torch.no_grad(): p.copy_(new), or load_state_dict)"
                )


def _layout(m: nn.Module) -> Tuple[int, int, int]:
    return len(m._parameters), len(m._modules), len(m._buffers)
