"""What every rank takes from the last joiner when torch's Join ends,
besides its parameters and buffers (replicas/uneven.py): the state of the optimizers
dmodel.optimizer made and of the LR schedulers attached to them. A rank that
joined early missed the last steps: its momentum, Adam moments and step
counts, and a per-step schedule's position, lag behind the last joiner's,
and the next block would step the ranks apart (torch DDP leaves them so).

A sharded optimizer (shard=True) stepped its shards on every rank under
Join (the joined ranks too): its state is current everywhere, and only its
hyper-parameters and schedulers are taken (its consolidated state would be
the whole unsharded state on every rank). A GradScaler that unscaled one
of these optimizers' gradients (seen by optim/amp.py) takes the last
joiner's scale and growth count: a joined rank missed its update() calls.

An optimizer pyddp did not make (the user's own over dmodel's parameters)
cannot be aligned safely (pyddp does not know it exists on every rank): if
it carries state that the missed steps would change (momentum, moments, a
scheduler), every rank refuses the next training forward, naming Join and
the remedy. Not at the end of Join itself: a run whose one Join block ends
its training (torch DDP's usual port) finishes as under DDP."""

from __future__ import annotations

import gc
from collections import Counter
from typing import List, Sequence

import torch
from torch.optim.lr_scheduler import LRScheduler

from .._link.control import Ranks
from .._link.joining import JOIN_OPTIMIZERS, JOIN_OPTIMIZERS_CHECK
from .amp import scaler_of
from .shards import hyper_of
from .zero import ShardedState


def schedulers_of(opt: torch.optim.Optimizer) -> List[LRScheduler]:
    """The LR schedulers stepping `opt` (found through the references they
    hold: torch keeps no list), in an order every rank agrees on (by class;
    two of one class on one optimizer cannot be told apart and raise)."""
    found: List[LRScheduler] = []
    for ref in gc.get_referrers(opt):
        # Python 3.11 reports the scheduler, older ones its __dict__.
        owners = [ref] if not isinstance(ref, dict) else gc.get_referrers(ref)
        for o in owners:
            if isinstance(o, LRScheduler) and o.optimizer is opt and o not in found:
                found.append(o)
    names = Counter(type(s).__qualname__ for s in found)
    twice = sorted(n for n, k in names.items() if k > 1)
    if twice:
        raise RuntimeError(
            f"pyddp: at the end of Join, {opt.__class__.__name__} has several "
            f"{twice[0]} schedulers, whose states pyddp cannot match between ranks; "
            "attach one scheduler per class (torch's SequentialLR or ChainedScheduler "
            "combine several)"
        )
    return sorted(found, key=lambda s: type(s).__qualname__)


def _stateful(opt: torch.optim.Optimizer) -> bool:
    """Whether steps this rank missed would have changed `opt`: a state
    (momentum buffers, moments, step counts) or a scheduler."""
    has_state = any(len(s) for s in opt.state.values())
    return has_state or any("initial_lr" in g for g in opt.param_groups)


def _sharded(opt: torch.optim.Optimizer) -> bool:
    return isinstance(opt.__dict__.get("_pyddp"), ShardedState)


def _describe(opt: torch.optim.Optimizer) -> str:
    return f"{type(opt).__module__}.{type(opt).__qualname__}"


def align_optimizers(
    ours: Sequence[torch.optim.Optimizer],
    stepping: Sequence[torch.optim.Optimizer],
    ranks: Ranks,
    source: int,
    steps: int,
) -> str:
    """On every rank, after the last joiner's parameters arrived: every
    optimizer dmodel.optimizer made (`ours`) takes the state of rank
    `source`'s (in the group's order), its schedulers too, or every rank
    raises. `stepping`: the optimizers seen stepping the model (its work
    record's); `steps`: this rank's optimizer steps before Join ended.
    Returns why the next training forward must be refused ("" if nothing)."""
    scheds = [schedulers_of(o) for o in ours]  # a scan of the heap each: once
    scalers = [scaler_of(o) for o in ours]
    mine = {id(o) for o in ours}
    foreign = [o for o in stepping if id(o) not in mine]
    summary = {
        "ours": [(_describe(o), [type(s).__qualname__ for s in ss]) for o, ss in zip(ours, scheds)],
        "foreign": [_describe(o) for o in foreign if _stateful(o)],
        "steps": steps,
        "scalers": [s is not None for s in scalers],
    }
    every = ranks.gather(summary, JOIN_OPTIMIZERS_CHECK)
    names = ranks.global_ranks
    ref = every[source]
    for r, got in enumerate(every):  # every rank sees every summary: raises alike
        if got["ours"] != ref["ours"]:
            raise RuntimeError(
                f"pyddp: at the end of Join, rank {names[r]} has the optimizers "
                f"{got['ours']} from dmodel.optimizer where rank {names[source]} (the last to "
                f"join) has {ref['ours']}; every rank must make the same optimizers and "
                "schedulers"
            )
    # Every rank's sharded optimizers are current: their groups' settings only.
    states = [
        (
            [hyper_of(g) for g in o.param_groups] if _sharded(o) else o.state_dict(),
            [s.state_dict() for s in ss],
            None if sc is None else sc.state_dict(),
        )
        for o, ss, sc in zip(ours, scheds, scalers)
    ]
    states = ranks.from_root(states, JOIN_OPTIMIZERS, root=source)
    if ranks.rank != source:
        for o, ss, sc, (state, sched_states, scaler_state) in zip(ours, scheds, scalers, states):
            if _sharded(o):
                for group, hyper in zip(o.param_groups, state):
                    group.update(hyper)
            else:
                o.load_state_dict(state)
            for s, st in zip(ss, sched_states):
                s.load_state_dict(st)
            if sc is not None and scaler_state is not None:
                sc.load_state_dict(scaler_state)
    unseen = [names[r] for r, got in enumerate(every) if got["scalers"] != ref["scalers"]]
    if unseen:
        return (
            f"pyddp: the last Join ended with rank(s) {unseen} whose GradScaler pyddp never "
            f"saw unscale this model's optimizers (no batch before joining?), where rank "
            f"{names[source]} (the last to join) used one: their loss scales may differ now, "
            "so training on is refused. Give every rank at least one batch, or load one "
            "rank's scaler.state_dict() into every rank's scaler after the Join block"
        )
    behind = [names[r] for r, got in enumerate(every) if got["steps"] != ref["steps"]]
    stateful = sorted({(names[r], name) for r, got in enumerate(every) for name in got["foreign"]})
    if not (behind and stateful):
        return ""
    rank, name = stateful[0]
    return (
        f"pyddp: the last Join ended with rank(s) {behind} behind the last joiner (rank "
        f"{names[source]}) by optimizer steps, and rank {rank} steps this model with its own "
        f"{name}, which holds state those steps would have changed (momentum, moments or an "
        "LR scheduler): its ranks differ now, so training on is refused. Make the optimizer "
        "with dmodel.optimizer(cls, ...), which pyddp aligns to the last joiner's when Join "
        "ends, or give every rank the same number of batches"
    )
