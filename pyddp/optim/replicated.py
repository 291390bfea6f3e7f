"""The replicated optimizer: one object that steps every replica. It is an
instance of a subclass of the user's optimizer class holding replica 0's
parameters, so LR schedulers, `isinstance` checks and `state_dict()` (one
copy) work unchanged; the other replicas' optimizers are stepped with the same
hyper-parameters. Replicas whose steps would run one after another step
once: the first replica on each GPU steps, and the others on it take its
parameters after (one copy), the bytes their own step would give; CPU
replicas likewise once their steps run in turn (step_once_if_in_turn). On
one GPU the replicas' steps run one after another anyway, each its
optimizer's Python and kernels, where a step of replicas sharing a GPU is
bound by the host (docs/gpus.md); and those replicas hold no optimizer
state."""

from __future__ import annotations

import copy
import functools
import operator
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch
from torch.autograd.graph import increment_version

from ..engine.faces import GradientShards
from ..errors import ReplicaError
from ..runtime.compiled import OutsideDynamo
from .base import OptimState, PyddpOptimizer, checked_norm_type, refuse_nonfinite


@dataclass
class ReplicatedState(OptimState):
    """Besides OptimState: the optimizers of replicas 1..N-1, and for each
    replica the one whose step it takes (itself where it steps)."""

    others: List[torch.optim.Optimizer]
    source: List[int]
    _followers: Optional[Dict[int, Tuple[List[torch.Tensor], List[torch.Tensor]]]] = field(
        default=None, init=False, repr=False
    )
    _trial_pairs: Optional[Tuple[List[torch.Tensor], List[torch.Tensor]]] = field(
        default=None, init=False, repr=False
    )
    _state_seen: Any = field(default=None, init=False, repr=False)  # see follow_state

    def __post_init__(self) -> None:
        super().__post_init__()
        # Replicas 0..width-1 get a step call (the last that steps, and
        # those before it): no hand-off to a worker past it.
        self.width = 1 + max(r for r, src in enumerate(self.source) if src == r)

    def optimizers(self, outer: Any) -> List[Any]:
        return [outer, *self.others]

    def follow_state(self, outer: Any) -> None:
        """Before a step: the user's optimizer (replica 0's) holds the state
        as its last step left it, or the user changed it since (a reset:
        `opt.state.clear()`, a new `opt.state`, a moment zeroed or replaced),
        which the replicas stepping their own optimizers then take too, or
        they would step from their old state and drift apart."""
        if self.width > 1 and _state_marks(outer.state) != self._state_seen:
            for r, other in enumerate(self.others, start=1):
                if self.stepping(r):
                    _give_state(outer, other)

    def stepped(self, outer: Any) -> None:
        """After a step: what follow_state compares with."""
        self._state_seen = _state_marks(outer.state) if self.width > 1 else None

    def stepping(self, r: int) -> bool:
        return self.source[r] == r

    def step_once_if_in_turn(self, outer: Any) -> bool:
        """CPU replicas step each on their worker, at once, while their
        steps run on threads; once in turn (wrap's run_replicas "in_turn",
        or "auto" once it chose so: the step is bound by its Python),
        replica 0 steps and the others copy its parameters, as replicas
        sharing a GPU do, and for good their optimizer state is dropped. On
        threads the copy would cost more than the parallel steps it replaces
        (1.04x the step of an MLP 784-1024-1024-10 on 2 CPU replicas,
        bench/ab_builds.py). Returns whether this step is one of "auto"'s
        trials in turn: see trial_steps."""
        if self.reducer.gpus is not None or self.width == 1:
            return False
        if self.reducer.runs_in_turn(self.kind):
            self.source, self.width, self._followers = [0] * len(self.source), 1, None
            for other in self.others:
                other.state.clear()
            return False
        return self.reducer.runs_in_turn(self.kind, settled=False)

    def trial_steps(self, outer: Any, step: Callable[[], Any]) -> Callable[[], Any]:
        """An "auto" trial in turn times what in turn keeps: replica 0's step
        and one copy of its parameters to the others (timed as every
        replica's step in turn, it kept threads for the step in 4 of 10
        wraps of an MLP 64-64-64-10 x2, at 1.3x the step in turn:
        bench/results/run_replicas_auto_before.json). The others still step
        their own, first and untimed (other_steps), so whichever way is kept
        each replica's optimizer holds its own state; the copy then writes
        the bytes they hold already, through `.data` (no version counter
        moves)."""
        if self._trial_pairs is None:
            into, froms = _follower_pairs(self.optimizers(outer), [0] * len(self.source))[0]
            self._trial_pairs = ([p.data for p in into], froms)
        into, froms = self._trial_pairs

        def step_and_copy() -> Any:
            out = step()
            with torch.no_grad():
                torch._foreach_copy_(into, froms)
            return out

        return step_and_copy

    def other_steps(self) -> None:
        """Replicas 1..N-1 step their own optimizers (an "auto" trial)."""
        for r, other in enumerate(self.others, start=1):
            try:
                other.step()
            except Exception as e:
                raise _OtherFailed(r, e) from e

    def _pairs(self, outer: Any) -> Dict[int, Tuple[List[torch.Tensor], List[torch.Tensor]]]:
        """Per stepping replica with followers: (the parameters of the
        replicas that take its step, its own parameters alike)."""
        if self._followers is None:  # (again after add_param_group)
            self._followers = _follower_pairs(self.optimizers(outer), self.source)
        return self._followers

    def stepper(self, outer: Any, r: int, step: Callable[[], Any]) -> Callable[[], Any]:
        """Replica r's step call: its optimizer's step, then the copy of the
        parameters it changed to the replicas that take its step. Both run
        where the replica's step runs (its thread, its GPU current, its
        intra-op thread count: a copy at another count beside the workers'
        would start an OpenMP team of another size, which stops libgomp's
        spinning process-wide; seen as 1.6x slower forwards after it)."""
        pairs = self._pairs(outer).get(r)
        if pairs is None:
            return step

        def step_and_copy() -> Any:
            before = list(map(_VERSION, pairs[1]))
            out = step()
            self.copy(*pairs, before)
            return out

        return step_and_copy

    @staticmethod
    def copy(into: List[torch.Tensor], froms: List[torch.Tensor], before: List[int]) -> None:
        """After the step: the replicas that do not step take their source's
        parameters, each one the step may have changed: its version counter
        moved since `before`, or it holds a gradient (an optimizer that
        writes through `.data` moves no counter). One with neither is equal
        on every replica already (a frozen one). The copies' counters then
        move as their source's did: the model's mirror (replicas/mirror.py)
        takes a replica whose counters moved otherwise than replica 0's for
        one changed alone, and copies it again before the next forward; a
        source the step wrote without moving its counter (torch's fused
        kernels, `.data` writes) moves by one, as its copies. Every pass
        over the parameters is C-level (map, compress): no Python per
        parameter."""
        moved = list(map(operator.sub, map(_VERSION, froms), before))
        changed = list(map(operator.or_, moved, map(operator.is_not, map(_GRAD, froms), _NONES)))
        if not any(changed):
            return
        with torch.no_grad():
            torch._foreach_copy_(list(compress(into, changed)), list(compress(froms, changed)))
        for extra in range(1, max(moved, default=0)):  # the copy moved each by one
            increment_versions(list(compress(into, map(extra.__lt__, moved))))
        if not all(moved):  # written, not moved (fused kernels, .data): the source moves once
            unmoved = compress(froms, map(operator.and_, changed, map(operator.not_, moved)))
            increment_versions(list({id(p): p for p in unmoved}.values()))


_VERSION = operator.attrgetter("_version")
_total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # (torch >= 2.6)
_GRAD = operator.attrgetter("grad")
_NONES = repeat(None)


def _state_marks(state: Dict[Any, Dict[str, Any]]) -> Tuple[int, List[int], List[int]]:
    """What tells an optimizer state edited since: the dict's identity, each
    value's, each tensor's version counter (in-place writes). C-level passes
    over the values: no Python per parameter."""
    try:
        values = list(chain.from_iterable(map(dict.values, state.values())))
    except TypeError:  # a state that is not torch's dict of dicts: not followed
        return (id(state), [], [])
    tensors = compress(values, map(isinstance, values, repeat(torch.Tensor)))
    return (id(state), list(map(id, values)), list(map(_VERSION, tensors)))


def versions(params: List[List[torch.Tensor]]) -> List[List[int]]:
    """Each replica's parameters' version counters (C-level passes)."""
    return [list(map(_VERSION, ps)) for ps in params]


def align_versions(params: List[List[torch.Tensor]], before: List[List[int]]) -> None:
    """After a step that moved each replica's parameters otherwise (a
    sharded one: its owner steps a parameter, the others copy it): every
    replica's counter raised to move as much as the most moved one's, so
    that the model's mirror (replicas/mirror.py) still tells a parameter
    the user changed on replica 0 alone before the next forward (an edit,
    model.load_state_dict) from the step's own moves. `before`: each
    replica's counters before the step."""
    moved = [list(map(operator.sub, map(_VERSION, ps), b)) for ps, b in zip(params, before)]
    most = list(map(max, *moved)) if len(moved) > 1 else moved[0]
    for ps, m in zip(params, moved):
        lag = list(map(operator.sub, most, m))
        for extra in range(1, max(lag, default=0) + 1):
            increment_versions(list(compress(ps, map(extra.__le__, lag))))


def increment_versions(tensors: List[torch.Tensor]) -> None:
    """torch.autograd.graph.increment_version on each (a list at once from
    torch 2.5 on; one at a time before)."""
    try:
        increment_version(tensors)
    except (TypeError, RuntimeError):  # torch 2.4: a tensor only
        for t in tensors:
            increment_version(t)


def _sources(reducer: GradientShards) -> List[int]:
    """Each replica's stepping replica: the first on its GPU; CPU replicas
    each step themselves (until step_once_if_in_turn)."""
    if reducer.gpus is None:
        return list(range(len(reducer.params)))
    first: Dict[int, int] = {}
    return [first.setdefault(gpu, r) for r, gpu in enumerate(reducer.gpus)]


def replicated_optimizer(
    reducer: GradientShards, cls: Type[torch.optim.Optimizer], groups: List[list], **kwargs: Any
) -> torch.optim.Optimizer:
    """`groups[r]`: replica r's parameters or param groups."""
    opt = _replicated_class(cls)(groups[0], **kwargs)
    others = [cls(g, **kwargs) for g in groups[1:]]
    mine = {id(p) for group in opt.param_groups for p in group["params"]}
    grads = [p for o in (opt, *others) for g in o.param_groups for p in g["params"]]
    owns_all = mine >= {id(p) for p in reducer.params[0]}
    opt._pyddp = ReplicatedState(
        reducer=reducer, grads=grads, owns_all=owns_all, others=others, source=_sources(reducer)
    )
    return opt


@functools.cache  # one subclass per optimizer class
def _replicated_class(cls: Type[torch.optim.Optimizer]) -> type:
    class Replicated(PyddpOptimizer, cls):  # type: ignore[misc, valid-type]
        def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
            state = self._pyddp
            self._pyddp_begin_step(closure, state.others)
            trial = state.step_once_if_in_turn(self)
            state.follow_state(self)
            if trial:
                steps = [state.trial_steps(self, super().step)]
            else:
                steps = [state.stepper(self, 0, super().step)] + [
                    state.stepper(self, r, other.step) if state.stepping(r) else _nothing
                    for r, other in enumerate(state.others[: state.width - 1], start=1)
                ]
            try:
                if trial:  # untimed: not a kind of work auto times
                    state.reducer.run_per_replica([state.other_steps], "auto's trial")
                out = state.reducer.run_per_replica(steps, state.kind)[0]
                state.stepped(self)
                return out
            except ReplicaError as e:
                # Some replicas stepped and some did not: make them all replica
                # 0 again (the user's model) before anything else runs.
                failed, cause = e.replica, e.cause
                if isinstance(cause, _OtherFailed):
                    failed, cause = cause.replica, cause.cause
                raise ReplicaError(failed, self._pyddp_resync(failed, trial), cause) from cause
            except BaseException:  # Ctrl-C: the replicas may have stepped unevenly too
                self._pyddp_resync(0)
                raise

        def _pyddp_resync(self, failed: int, before_zero: bool = False) -> str:
            done = (
                "raised part-way (its parameters and state as they were then)"
                if failed == 0
                else "had not stepped yet"
                if before_zero
                else "completed its step"
            )
            try:
                with torch.no_grad():
                    for r, other in enumerate(self._pyddp.others, start=1):
                        for mine, theirs in zip(self.param_groups, other.param_groups):
                            for p0, p in zip(mine["params"], theirs["params"]):
                                p.copy_(p0)
                        if self._pyddp.stepping(r):  # (the others hold no state)
                            _give_state(self, other)
            except Exception as e:  # the replicas now differ: refuse every later step
                self._pyddp.give_up(
                    f"pyddp: an optimizer step failed on replica {failed} and copying replica "
                    f"0's parameters and optimizer state to the other replicas failed too "
                    f"({type(e).__name__}: {e}); the replicas differ: wrap the model again"
                )
                return f"optimizer step; the replicas now differ ({self._pyddp.broken})"
            return (
                "optimizer step; every replica's parameters and optimizer state (its `state`; "
                f"what an optimizer keeps on itself is not copied) were reset to replica 0's, "
                f"which {done}"
            )

        def _pyddp_add_group(self, param_group: Dict[str, Any]) -> None:
            """`param_group["params"]` are the wrapped model's (replica 0's)
            parameters; each replica's optimizer gets its own copies' group."""
            state = self._pyddp
            reducer, others = state.reducer, state.others
            params = param_group.get("params")
            params = [params] if isinstance(params, torch.Tensor) else list(params or [])
            index = {id(p): i for i, p in enumerate(reducer.params[0])}
            unknown = [p for p in params if id(p) not in index]
            if unknown:
                raise ValueError(
                    f"add_param_group: {len(unknown)} parameter(s) are not trainable parameters "
                    "of the wrapped model (replica 0's, requires_grad=True when wrapped); pyddp "
                    "steps each replica's own copy of the ones it knows"
                )
            # The user's class: PyddpOptimizer's own would call back here.
            super(PyddpOptimizer, self).add_param_group({**param_group, "params": params})  # type: ignore[misc]
            for r, other in enumerate(others, start=1):
                copies = [reducer.params[r][index[id(p)]] for p in params]
                other.add_param_group({**param_group, "params": copies})
            state.grads += [p for ps in reducer.params for p in (ps[index[id(q)]] for q in params)]
            state._followers = state._trial_pairs = None
            mine = {id(p) for group in self.param_groups for p in group["params"]}
            state.owns_all = mine >= {id(p) for p in reducer.params[0]}

        # The parent's step is already wrapped with the optimizer's step hooks;
        # marking this one as wrapped keeps each hook to one call per step.
        step.hooked = True  # type: ignore[attr-defined]
        step = OutsideDynamo(step)  # type: ignore[assignment]  # (every replica's step eager)

        def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
            super().load_state_dict(state_dict)
            for r, other in enumerate(self._pyddp.others, start=1):
                # torch keeps the given state tensors when device and dtype match:
                # each replica needs its own, or one buffer would be stepped N times.
                if self._pyddp.stepping(r):
                    other.load_state_dict(copy.deepcopy(state_dict))

    Replicated.__name__ = Replicated.__qualname__ = f"Replicated{cls.__name__}"
    return Replicated


def clip_replicas(
    grads0: List[torch.Tensor],
    flats: Sequence[Sequence[torch.Tensor]],
    max_norm: float,
    norm_type: float,
    strict: bool,
) -> torch.Tensor:
    """dmodel.clip_grad_norm_ over replicas that each hold the whole reduced
    gradient (`flats[r]`: replica r's flat buckets): the norm is that of
    replica 0's gradients (`grads0`), taken as torch's clip takes it, per
    tensor (one norm over a whole bucket was 1.4e-3 off on 25M elements:
    torch's float32 norm of one large tensor), and every replica scales by
    the same coefficient. Returns it."""
    norm_type = checked_norm_type(norm_type)
    if not grads0:
        total = torch.tensor(0.0)
    elif _total_norm is not None:
        total = _total_norm(grads0, norm_type)
    else:  # torch < 2.6
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads0]
        total = torch.linalg.vector_norm(
            torch.stack([n.to(norms[0].device) for n in norms]), norm_type
        )
    if strict:  # error_if_nonfinite
        refuse_nonfinite(total, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in flats:
        torch._foreach_mul_(list(grads), coef.to(grads[0].device))
    return total


def _follower_pairs(
    opts: Sequence[torch.optim.Optimizer], source: Sequence[int]
) -> Dict[int, Tuple[List[torch.Tensor], List[torch.Tensor]]]:
    """For each replica that others take the step of (`source[r]`: whose
    step replica r takes): (their parameters, its own alike), in order."""
    pairs: Dict[int, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
    for r, src in enumerate(source):
        if r == src:
            continue
        into, froms = pairs.setdefault(src, ([], []))
        for mine, theirs in zip(opts[src].param_groups, opts[r].param_groups):
            froms += mine["params"]
            into += theirs["params"]
    return pairs


def _give_state(outer: Any, other: torch.optim.Optimizer) -> None:
    """Replica 0's optimizer `state`, a copy of each value to another
    replica's optimizer: tensors keep their dtype (load_state_dict would
    cast a float64 buffer to a float32 parameter's dtype)."""
    other.state.clear()
    for mine, theirs in zip(outer.param_groups, other.param_groups):
        for p0, p in zip(mine["params"], theirs["params"]):
            if p0 in outer.state:
                other.state[p] = {
                    k: v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)
                    for k, v in outer.state[p0].items()
                }


class _OtherFailed(Exception):
    """Replica `replica`'s own step raised during an "auto" trial."""

    def __init__(self, replica: int, cause: BaseException):
        super().__init__(f"replica {replica}: {type(cause).__name__}: {cause}")
        self.replica, self.cause = replica, cause


def _nothing() -> None:
    """A replica's step taken by copying another's (ReplicatedState.copy)."""
