"""Keeps the replicas following replica 0, which is the user's own model object:
whatever the user does to it after `wrap` must reach the other replicas or stop
the next forward with an error that names it. Checked before every forward, in
O(modules + parameters) attribute reads:

- train/eval modes and `requires_grad` are copied to the other replicas;
- a parameter's own gradient hooks (`p.register_hook`, e.g. a mask) run on
  every replica's gradient, as on every rank under torch DDP: each replica
  parameter shares replica 0's hook dict (a deepcopy drops it), so hooks
  added or removed later reach every replica, and a dict made by the first
  `register_hook` after wrap is shared before the next forward;
- a parameter changed in place on one replica only (`model.load_state_dict`,
  an optimizer over `model.parameters()`, a manual edit) is seen through the
  tensors' version counters (moved after a fused step too: optim/fused.py),
  which the replicated optimizer and `dmodel.load_state_dict` advance in step
  on every replica, and replica 0's value is copied to the others;
- what cannot follow (a module or parameter added, removed or replaced, a new
  dtype, device or shape, unfreezing a parameter frozen at wrap time) raises.

One replica in a process of several: watch.py."""

from __future__ import annotations

import contextlib
import copy
import operator
from itertools import chain, repeat
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..engine.hooks import (
    accumulate_hook_marks,
    refuse_accumulate_hooks,
    refuse_accumulate_hooks_at_wrap,
)
from ..optim.fused import follow_fused_steps
from ..runtime.libraries import DTYPE_NAMES
from .attributes import Attributes, Storages, shared_at_copy


def replica_copies(model: nn.Module, devices: Sequence[torch.device]) -> List[nn.Module]:
    """`model` (replica 0, on devices[0]) and a deep copy on each other device;
    a model that cannot be deep-copied is refused naming why and what works."""
    refuse_accumulate_hooks_at_wrap(model, len(devices))
    try:
        return [model] + [copy.deepcopy(model, shared_at_copy(model)).to(d) for d in devices[1:]]
    except RuntimeError as e:
        if "deepcopy protocol" not in str(e):
            raise
        raise TypeError(
            "pyddp: the model cannot be copied for the other replicas: a module holds a computed "
            "tensor as an attribute (torch.nn.utils.prune's `weight` from `weight_orig` and its "
            "mask, or torch.nn.utils.weight_norm's old API). Make pruning permanent first "
            "(prune.remove), use torch.nn.utils.parametrizations (weight_norm, spectral_norm) "
            "or torch.nn.utils.parametrize, or run one replica per process under torchrun"
        ) from e


_REWRAP = "dmodel.close() and wrap the model again (or make the change before wrapping)"


@contextlib.contextmanager
def planned_as_trainable(replicas: Sequence[nn.Module], on: bool) -> Iterator[None]:
    """wrap's follow_unfreezing: inside, the replicas' frozen parameters of a
    dtype pyddp reduces require grad, so the reducer plans them and hooks them;
    after, they are frozen again, as if frozen just after wrap (which is
    followed). Others (a quantized base) stay out, and unfreezing them raises."""
    frozen = [
        p for m in replicas for p in m.parameters() if not p.requires_grad
        if p.dtype in DTYPE_NAMES
    ] if on else []  # fmt: skip
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def unfrozen(name: str, p: torch.Tensor, who: str) -> str:
    """The refusal of a parameter frozen at wrap that now requires grad."""
    if p.dtype in DTYPE_NAMES:
        fix = (
            f"{_REWRAP}; wrap(..., follow_unfreezing=True) plans frozen parameters so that "
            "unfreezing them is followed, and freezing after wrap always is (in Lightning: "
            "strategy=pyddp.lightning.PyddpStrategy(follow_unfreezing=True); in the "
            "transformers Trainer: PyddpTrainer(pyddp_options={'follow_unfreezing': True}))"
        )
    else:
        fix = f"pyddp does not reduce {p.dtype} gradients"
    return (
        f"pyddp: parameter {name!r} was frozen when the model was wrapped and now requires "
        f"grad; its gradient is not reduced, so the {who} would diverge: {fix}"
    )


class ReplicaMirror:
    def __init__(self, replicas: Sequence[nn.Module], synced: Sequence[str]):
        self.modules: List[List[nn.Module]] = [list(m.modules()) for m in replicas]
        self.module_names = [n or "(the model)" for n, _ in replicas[0].named_modules()]
        self.layout = self._layout()
        self.reattach_due = False  # (follow_at_step saw new storage: the next follow says so)
        # The dicts behind the layout, flat: follow() compares their sizes in
        # one C-level pass (no Python per module per forward).
        self.layout_dicts = [d for m in self.modules[0] for d in _LAYOUT_DICTS(m)]
        self.layout_sizes = list(chain.from_iterable(self.layout))
        # Hooks replaced (removed and another registered: the count stays)
        # show in each hook dict's last key, a handle id that only grows.
        self.hook_dicts0 = _hook_dicts(self.modules[0])
        self.hook_keys = _last_keys(self.hook_dicts0)
        # Read again only after some hook was registered anywhere (torch
        # numbers every handle from one counter): O(1) in the steady state,
        # where the pass over every module's hook dicts costs ~50 us (150 modules).
        self.handles_seen = RemovableHandle.next_id
        self.replica_hooks = [_hook_marks(mods) for mods in self.modules]
        self.members = self._members()
        self.attributes = Attributes(self.modules)
        # Every parameter slot (module, local name) of replica 0, frozen ones included.
        slots = [
            (m._parameters, f"{where}.{name}" if where != "(the model)" else name, p)
            for m, where in zip(self.modules[0], self.module_names)
            for name, p in m._parameters.items()
            if p is not None
        ]
        self.slot_labels = [label for _, label, _ in slots]
        self.slot_dicts = [d for d, _, _ in slots]
        self.slot_names = [label.rpartition(".")[2] for _, label, _ in slots]
        self.slot_params = [p for _, _, p in slots]
        named = [dict(m.named_parameters()) for m in replicas]
        self.names = list(named[0])
        self.params: List[List[nn.Parameter]] = [[d[n] for n in self.names] for d in named]
        follow_fused_steps(self.params[0])  # (they move no version counter)
        self.accumulating = [accumulate_hook_marks(ps) for ps in self.params]
        self.meta = [(p.dtype, p.device, p.shape) for p in self.params[0]]
        self.synced = set(synced)
        self.training = [m.training for m in self.modules[0]]
        self.classes = list(map(type, self.modules[0]))
        self.storage = Storages(self.params[0])
        self.head = list(map(_version_and_grad, self.params[0]))
        self.hook_dicts: List[object] = []
        self._share_hooks()
        self.versions = [list(map(_version, ps)) for ps in self.params[1:]]
        # Every buffer slot (module's dict, local name) of every replica, in
        # the same order: follow() keeps the modules and their buffer counts
        # those of wrap time, and a slot reads whatever tensor is there now.
        self.buffer_slots = [
            [(m._buffers, n) for m in mods for n in m._buffers] for mods in self.modules
        ]
        self._saw_buffers()

    def _buffers(self, r: int) -> List[Any]:
        return [d.get(n) for d, n in self.buffer_slots[r]]

    def _saw_buffers(self) -> None:
        """Every replica's buffers (and version counters) as copy_buffers
        leaves them: what a later change is told from."""
        self.seen = [self._buffers(r) for r in range(len(self.buffer_slots))]
        self.buffer_versions = [list(map(_version_of, bufs)) for bufs in self.seen]

    def copy_buffers(self, changed_only: bool = False) -> None:
        """Copies replica 0's buffers to the others, slot by slot, in one
        foreach copy: O(buffers) with no walk over the modules
        (module.buffers() costs 84 us per replica on a 12-layer GPT-2, at
        every forward). A buffer replaced on replica 0 (or set to None) is
        replaced alike where its shape or dtype changed. `changed_only`
        (broadcast_buffers=False: each replica keeps what its own forwards
        wrote, in place or rebinding): only those the user changed on
        replica 0 alone since (load_state_dict, an in-place write: its
        version counter moved otherwise than the other's, which BatchNorm's
        statistics do not; a buffer replaced), each where that replica's
        own forward did not rebind it."""
        now0 = self._buffers(0)
        kept0 = list(map(operator.is_, now0, self.seen[0]))  # not rebound on replica 0
        due = self._changed_by_user(now0, kept0) if changed_only else None
        if not all(kept0):
            self._replace_buffers(now0, kept0, due)
        pairs = [
            (b, b0)
            for r, flags in zip(range(1, len(self.seen)), due or repeat(repeat(True)))
            for b, b0, go in zip(self._buffers(r), now0, flags)
            if go and b is not None and b0 is not None
        ]
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([a for a, _ in pairs], [b for _, b in pairs])
        if changed_only:
            self._saw_buffers()
        else:
            self.seen[0] = now0

    def _changed_by_user(self, now0: List[Any], kept0: List[bool]) -> List[List[bool]]:
        """Per other replica and buffer slot: whether the user changed it on
        replica 0 alone since the last forward (see copy_buffers)."""
        moved0 = list(map(operator.sub, map(_version_of, now0), self.buffer_versions[0]))
        due = []
        for r in range(1, len(self.seen)):
            bufs = self._buffers(r)
            kept = map(operator.is_, bufs, self.seen[r])
            moved = map(operator.sub, map(_version_of, bufs), self.buffer_versions[r])
            due.append([
                mine and (not k0 or m != m0)
                for mine, k0, m, m0 in zip(kept, kept0, moved, moved0)
            ])  # fmt: skip
        return due

    def _replace_buffers(
        self, now0: List[Any], kept0: List[bool], due: Optional[List[List[bool]]]
    ) -> None:
        """Buffers replaced on replica 0: None on the others where None there,
        a copy where the shape or dtype changed (values follow in the copy)."""
        for r in range(1, len(self.seen)):
            held = [p.device for p in self.params[r][:1]]
            flags = due[r - 1] if due is not None else repeat(True)
            for (d, n), b0, same, go in zip(self.buffer_slots[r], now0, kept0, flags):
                b = d.get(n)
                if same or not go or (b is not None and b0 is not None and b.shape == b0.shape
                                      and b.dtype == b0.dtype):  # fmt: skip
                    continue
                device = b.device if b is not None else (held or [None])[0]
                d[n] = None if b0 is None else b0.detach().to(device, copy=True)

    def copy_all(self) -> None:
        """Copies replica 0's parameters to the others, unconditionally, in
        its memory format (`.to(memory_format=...)` after wrap: each bucket
        view is laid out as its parameter, the same on every replica)."""
        with torch.no_grad():
            for ps in self.params[1:]:
                for p, p0 in zip(ps, self.params[0]):
                    if p.stride() != p0.stride():
                        p.data = torch.empty_like(p0, device=p.device)
                    p.copy_(p0)
        self.versions = [list(map(_version, ps)) for ps in self.params[1:]]

    def follow(self) -> bool:
        """Before a forward: brings replicas > 0 in line with replica 0, or
        raises. Each check is one pass over replica 0 (and the version counters
        of every replica) with work only where something changed. Returns
        whether replica 0's parameters got new storage (their gradients may
        have too: the caller re-attaches them and copies every parameter)."""
        if list(map(len, self.layout_dicts)) != self.layout_sizes or (
            RemovableHandle.next_id != self.handles_seen
            and _last_keys(self.hook_dicts0) != self.hook_keys
        ):
            self._structure_changed()
        if RemovableHandle.next_id != self.handles_seen:  # (its own hooks: pyddp's Python path)
            self.accumulating = refuse_accumulate_hooks(self.names, self.params, self.accumulating)
        self.handles_seen = RemovableHandle.next_id
        if not all(map(operator.is_, self._members(), self.members)):
            self._raise_member_replaced()
        if not all(
            map(operator.is_, map(dict.get, self.slot_dicts, self.slot_names), self.slot_params)
        ):
            self._raise_replaced()
        self.attributes.follow()
        first = self.params[0]
        if not all(map(operator.is_, map(_hook_dict, first), self.hook_dicts)):
            self._share_hooks()
        training = list(map(_TRAINING, self.modules[0]))
        if training != self.training:
            for mods in self.modules[1:]:
                for m, flag in zip(mods, training):
                    m.training = flag
            self.training = training
        classes = list(map(type, self.modules[0]))
        if not all(map(operator.is_, classes, self.classes)):  # `m.__class__ = Sub` after wrap
            for mods in self.modules[1:]:
                for m, cls in zip(mods, classes):
                    m.__class__ = cls
            self.classes = classes
        drifted = set()
        self.moved_now = self.storage.moved_ids()  # (the caller copies every parameter)
        new_storage = bool(self.moved_now)
        if new_storage:
            # New tensors behind the parameters (`.data =`, `.to()`, `.half()`):
            # the same dtype, device and shape is a value change, else refused.
            for k, (p, (dtype, device, shape)) in enumerate(zip(first, self.meta)):
                if p.dtype != dtype or p.device != device or p.shape != shape:
                    raise RuntimeError(
                        f"pyddp: parameter {self.names[k]!r} of the wrapped model changed from "
                        f"{dtype} {tuple(shape)} on {device} to {p.dtype} {tuple(p.shape)} on "
                        f"{p.device} after wrap; the other replicas cannot follow: {_REWRAP}"
                    )
            self.storage = Storages(first)
        head = list(map(_version_and_grad, first))  # one pass: version, requires_grad
        requires_grad = [wants for _, wants in head]
        if requires_grad != [wants for _, wants in self.head]:
            for k, wants in enumerate(requires_grad):
                if wants and self.names[k] not in self.synced:
                    raise RuntimeError(unfrozen(self.names[k], first[k], "replicas"))
                for ps in self.params[1:]:
                    if ps[k].requires_grad is not wants:
                        ps[k].requires_grad_(wants)
        versions = [list(map(_version, ps)) for ps in self.params[1:]]
        if head != self.head or versions != self.versions:
            # In-place changes must have reached every replica alike (the
            # replicated optimizer, dmodel.load_state_dict); where they did not,
            # replica 0's value is the model's.
            moved0 = [v - before for (v, _), (before, _) in zip(head, self.head)]
            for now, before in zip(versions, self.versions):
                delta = list(map(operator.sub, now, before))
                if delta != moved0:
                    drifted.update(k for k, (a, b) in enumerate(zip(delta, moved0)) if a != b)
        if drifted:
            with torch.no_grad():
                for k in drifted:
                    for ps in self.params[1:]:
                        ps[k].copy_(first[k])
            versions = [list(map(_version, ps)) for ps in self.params[1:]]
        self.head, self.versions = head, versions
        moved, self.reattach_due = new_storage or self.reattach_due, False
        return moved

    def follow_at_step(self) -> None:
        """follow() before a sharded step (each replica steps its share from its copy); new
        storage (`p.data = ...`) is copied as values, the gradients re-attached at the next
        forward's follow() (here that would drop the reduced gradient the step uses)."""
        if self.follow():
            self.copy_all()
            self.reattach_due = True

    def _share_hooks(self) -> None:
        """Every replica's parameter runs replica 0's tensor hooks: it holds
        the same dict (read by torch when the gradient arrives)."""
        self.hook_dicts = list(map(_hook_dict, self.params[0]))
        for ps in self.params[1:]:
            for p, hooks in zip(ps, self.hook_dicts):
                if hooks is not None and p._backward_hooks is not hooks:
                    p._backward_hooks = hooks

    def _layout(self) -> List[Tuple[int, ...]]:
        """Per module of replica 0: how many parameters, submodules and buffers,
        then how many forward, forward-pre, backward and backward-pre hooks."""
        return [tuple(map(len, _LAYOUT_DICTS(m))) for m in self.modules[0]]

    def _members(self) -> List[object]:
        """Every child module of replica 0, by identity (C-level passes).
        (Buffers are copied from replica 0 before each forward, replaced
        ones included.)"""
        return list(chain.from_iterable(map(dict.values, map(_MODULES, self.modules[0]))))

    def _structure_changed(self) -> None:
        """Replica 0's modules or hooks changed since wrap (or since the last
        change followed). Hooks that changed on every replica alike (each
        replica's own forward registered them: transformers' output capture
        under output_hidden_states=True) are followed; hooks added, removed
        or replaced on the user's model alone are refused, and so is any
        change of submodules, parameters or buffers."""
        layout = self._layout()
        if any(a[:3] != b[:3] for a, b in zip(layout, self.layout)):
            self._raise_structure(layout)
        marks = [_hook_marks(mods) for mods in self.modules]
        moved = list(map(_moved, marks, self.replica_hooks))
        for (counts, _), changed in zip(marks[1:], moved[1:]):
            if counts != marks[0][0] or changed != moved[0]:
                k = next((k for k, c in enumerate(moved[0]) if c), 0)  # one that moved on replica 0
                self._raise_hooks(k // len(_HOOK_NAMES))
        self.layout = layout
        self.layout_sizes = list(chain.from_iterable(layout))
        self.hook_keys, self.replica_hooks = marks[0][1], marks

    def _raise_hooks(self, j: int) -> None:
        raise RuntimeError(
            f"pyddp: hooks of the wrapped model's module {self.module_names[j]!r} changed after "
            "wrap; only replica 0 would run them, so the replicas' rows would be computed "
            f"differently: {_REWRAP}, with the hooks registered first"
        )

    def _raise_structure(self, layout: List[Tuple[int, ...]]) -> None:
        j = next(j for j, (a, b) in enumerate(zip(layout, self.layout)) if a != b)
        where = self.module_names[j]
        if layout[j][:3] == self.layout[j][:3]:
            self._raise_hooks(j)
        raise RuntimeError(
            f"pyddp: the wrapped model's module {where!r} gained or lost submodules, "
            "parameters or buffers after wrap (add_module, register_parameter, ...); "
            f"the other replicas cannot follow: {_REWRAP}"
        )

    def _raise_member_replaced(self) -> None:
        """Names the first child module of replica 0 that is not the one
        wrapped (a probe: resize_token_embeddings was named "model.head")."""
        labels = (
            f"{where}.{name}" if where != "(the model)" else name
            for m, where in zip(self.modules[0], self.module_names)
            for name in m._modules
        )
        for label, now, then in zip(labels, self._members(), self.members):
            if now is not then:
                raise RuntimeError(
                    f"pyddp: submodule {label!r} of the wrapped model was replaced after wrap "
                    f"({type(then).__name__} then, {type(now).__name__} now; by an assignment, "
                    "a peft merge, transformers' resize_token_embeddings); the other replicas "
                    f"cannot follow: {_REWRAP}"
                )

    def _raise_replaced(self) -> None:
        slots = zip(self.slot_dicts, self.slot_names, self.slot_params, self.slot_labels)
        for d, name, p, label in slots:
            if d.get(name) is not p:
                raise RuntimeError(
                    f"pyddp: parameter {label!r} of the wrapped model was replaced after wrap; "
                    f"the other replicas cannot follow: {_REWRAP} (to change values, assign in "
                    "place, e.g. with torch.no_grad(): p.copy_(new), or load_state_dict)"
                )


_HOOK_NAMES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_LAYOUT_DICTS = operator.attrgetter("_parameters", "_modules", "_buffers", *_HOOK_NAMES)
_HOOKS = operator.attrgetter(*_HOOK_NAMES)
_TRAINING = operator.attrgetter("training")
_MODULES = operator.attrgetter("_modules")
_version = operator.attrgetter("_version")


def _version_of(b: Any) -> int:
    return -1 if b is None else b._version


_hook_dict = operator.attrgetter("_backward_hooks")
_version_and_grad = operator.attrgetter("_version", "requires_grad")


def _hook_dicts(modules: Sequence[nn.Module]) -> List[Dict[Any, Any]]:
    """Every module's hook dicts, flat (_HOOK_NAMES per module)."""
    return list(chain.from_iterable(map(_HOOKS, modules)))


def _last_keys(dicts: Sequence[Dict[Any, Any]]) -> List[Any]:
    """Each dict's last key (None if empty): C-level passes."""
    return list(map(next, map(reversed, dicts), repeat(None)))


def _hook_marks(modules: Sequence[nn.Module]) -> Tuple[List[int], List[Any]]:
    """Per hook dict of these modules: how many hooks, and the last one's key."""
    dicts = _hook_dicts(modules)
    return list(map(len, dicts)), _last_keys(dicts)


def _moved(now: Tuple[List[int], List[Any]], was: Tuple[List[int], List[Any]]) -> List[bool]:
    """Per hook dict: whether its hooks changed between two _hook_marks."""
    counts, keys = map(operator.ne, now[0], was[0]), map(operator.ne, now[1], was[1])
    return list(map(operator.or_, counts, keys))
