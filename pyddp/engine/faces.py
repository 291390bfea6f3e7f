"""The reducer's two narrow faces (reducer.py keeps its state private):

- `ReplicaDriver`: what the wrapped model (replicas/) drives, the
  per-backward protocol and its detours, nothing of the engine, layout or
  plan behind it. The link, the work record and the GPU placement are the
  model's own: params.assemble makes them and both hold them.
- `GradientShards`: what the optimizers (optim/) see: the parameters of
  every replica, the slot (rank) of each, the buckets and their sharding,
  the reduced blocks, and the few calls a sharded step makes.

tests/test_layout.py checks that replicas/ and optim/ use nothing else."""

from __future__ import annotations

import operator
import weakref
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    List,
    Optional,
    Protocol,
    Sequence,
    Set,
)

from torch.distributed.algorithms.join import JoinHook

from .._link.control import Ranks
from .._link.joining import join_device
from .._link.route import DeviceRoute
from .ending import gradients_cleared
from .hooks import refuse_state_dict


class ReplicaDriver(Protocol):
    """The reducer as the wrapped model drives it (replicas/)."""

    @property
    def reduces(self) -> bool: ...  # False: one replica, one process
    @property
    def syncing(self) -> bool: ...  # the next backward reduces
    @property
    def closed(self) -> bool: ...
    @property
    def sharded(self) -> bool: ...  # shard='gradients'

    carried: bool  # the buckets carry the last reduction into this backward (no zero_grad)

    # one training step, in order
    def prepare_all(self) -> None: ...
    def note_forward_end(self) -> None: ...
    def restart_accumulation(self, params_moved: Callable[[], Set[int]]) -> None: ...
    def finish(self) -> None: ...
    def check_step(self) -> None: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...

    # the detours
    def no_sync(self) -> ContextManager[None]: ...
    def shadow_backward(self) -> None: ...
    def abort(self, reason: str = ...) -> None: ...
    def grads_moved(self, assigned: bool = True) -> bool: ...
    def reattach(self, params_moved: Optional[Callable[[], Set[int]]] = None) -> None: ...
    def register_comm_hook(self, state: Any, hook: Any) -> None: ...

    # what the model reads and hands on
    def flat_grads(self, replica: int) -> List[Any]: ...
    def gradients(self) -> GradientShards: ...
    def stats(self) -> Dict[str, Any]: ...
    def reset_stats(self) -> None: ...
    def export_timeline(self, path: Any) -> Any: ...
    def ready_times(self) -> Any: ...
    def close(self, settle: bool = True) -> None: ...


class GradientShards:
    """The reducer as the optimizers see it (optim/): made by
    Reducer.gradients(), holding the reducer (an optimizer keeps its model's
    reducer alive, as before; the reducer never holds this view)."""

    params: List[List[Any]]  # [replica][parameter], in the reducer's order
    names: List[str]  # the parameters' names
    replicas: List[Any]  # this process's replica modules
    on_gpus: bool  # GPU replicas, reduced (the engine's backend runs the collectives)
    gpus: Optional[List[int]]  # each replica's GPU (real or simulated), or None
    ranks: Ranks  # the processes: replica counts, the exchanges a sharded step makes

    def __init__(self, reducer: Any):  # a Reducer (reducer.py imports this file)
        self._r = reducer
        self.params, self.names = reducer._params, reducer._names
        self.replicas = reducer._replicas
        self.on_gpus = reducer._gpu_devices is not None and reducer._engine is not None
        self.gpus = None if reducer._gpu_devices is None else list(reducer._gpu_devices)
        self.ranks = reducer._link.ranks
        self._follow: Optional[Callable[[], Any]] = None  # a weak DistributedModel method

    def follow_model_with(self, method: Callable[[], None]) -> None:
        """The wrapped model's check that brings its other replicas in line
        with the user's model before a step (Mirror.follow_at_step), kept weakly."""
        self._follow = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def follow_model(self) -> None:
        """Before a sharded step: values changed in place on the user's
        model since the forward (SAM restoring its weights, load_state_dict)
        reach the other replicas, which step their shares from their copies."""
        follow = None if self._follow is None else self._follow()
        if follow is not None:
            follow()

    def refuse_model_state(self, why: str) -> None:
        """The user's model's state_dict() raises `why` from now on (a step
        left it half-stepped); close() lifts it, as it removes every hook."""
        if not self._r.closed:
            self._r._handles.extend(refuse_state_dict(self.replicas[0], why))

    # ------------------------------------------------------------ the slots
    def slot_of(self, replica: int) -> int:
        """`replica`'s rank among every replica of every process: on GPUs
        its NCCL rank (NCCL numbers a process's GPUs by device, so [1, 0]
        has replica 0 at rank first + 1), else its place after the replicas
        of the ranks before this one."""
        if self.on_gpus:
            return self._r._backend.rank_of(replica)
        return sum(self.ranks.replicas_per_rank[: self.ranks.rank]) + replica

    def route(self) -> Optional[DeviceRoute]:
        """GPU replicas: collectives outside the buckets on the engine's
        backend, on the replicas' current streams (None on CPUs)."""
        if not self.on_gpus:
            return None
        return DeviceRoute(self._r._backend, self._r._gpu_devices, self._r._streams)

    # ---------------------------------------------------------- the buckets
    @property
    def buckets(self) -> List[List[int]]:
        return self._r.buckets

    @property
    def scatter_ranks(self) -> int:
        """The ranks every bucket is reduce-scattered over (0: all-reduced)."""
        engine = self._r._engine
        return 0 if engine is None else engine.scatter_ranks

    def set_scatter(self, ranks: int) -> None:
        """Reduce-scatter every bucket over `ranks` from now on (the plan is final)."""
        self._r._plan.set_scatter(ranks)

    @property
    def hook_set(self) -> bool:
        """A communication hook sees the buckets."""
        return self._r._engine is not None and self._r._plan.hook_set

    @property
    def gradients_sharded(self) -> bool:
        """Each replica keeps only its blocks of the reduced buckets."""
        return self._r._engine is not None and self._r._layout.scattered is not None

    def refuse_unsynced_step(self) -> None:
        """Before a step of the user's optimizer (one replica per process:
        optim/unsynced.py): gradients accumulated under no_sync() and never
        reduced are refused, as pyddp's own optimizers refuse them."""
        engine, r = self._r._engine, self._r
        unsynced = engine is not None and not r.closed and engine.partial
        if unsynced and not gradients_cleared(r._layout):  # (torch's zero_grad: nothing to step)
            raise RuntimeError(f"pyddp: cannot step: {engine.partial_reason}")

    def flat_grads(self, replica: int) -> List[Any]:
        """`replica`'s gradients as held: flat buckets, blocks, or `.grad`."""
        return self._r.flat_grads(replica)

    @property
    def blocks(self) -> List[List[Any]]:
        """Under shard='gradients': each replica's reduced blocks, one per bucket."""
        return [list(held) for held in self._scattered().blocks]

    def block_piece(self, replica: int, i: int, lo: int, hi: int) -> Optional[Any]:
        """Elements [lo, hi) of parameter i's reduced gradient in `replica`'s
        blocks; None where the parameter holds no gradient (the step skips it,
        as on one device)."""
        scattered = self._scattered()
        return scattered.piece(replica, i, lo, hi) if scattered.present[i] else None

    def after_step(self) -> None:
        """The placeholders on the model again (scattered.py): a gradient
        reset before the next backward is seen."""
        self._scattered().place()

    def _scattered(self) -> Any:
        scattered = None if self._r._engine is None else self._r._layout.scattered
        if scattered is None:
            raise RuntimeError("pyddp: the gradients are not sharded (shard='gradients')")
        return scattered

    @property
    def under_join(self) -> bool:
        """torch's Join runs a step of this rank's right now."""
        return self._r._link.joining.step is not None

    def announce_sharded_step(self, optimizer: Any) -> None:
        """Under Join, on a rank with inputs, before `optimizer` (sharded)
        steps: the wrapped model tells the joined ranks to step theirs."""
        announce = self._r._link.joining.before_sharded_step
        if announce is None:
            raise RuntimeError(
                "pyddp: a sharded optimizer steps under a Join that pyddp's wrapped model is "
                "not part of; pass the wrapped model to torch's Join (or use dmodel.join())"
            )
        announce(optimizer)

    def join_hook(self) -> Any:
        """torch's Joinable, for a sharded optimizer in torch's Join beside
        its wrapped model (`Join([dmodel, opt])`, as ported code passes
        ZeroRedundancyOptimizer): the model's hook, made first, shadows the
        steps; the optimizer's own does nothing."""
        if self._r._link.joining.before_sharded_step is None:
            raise ValueError(
                "pyddp: a sharded optimizer in torch's Join needs its wrapped model before it "
                "(Join([dmodel, opt])): the model's join hook steps the optimizer's shards on "
                "the ranks that joined"
            )
        return JoinHook()

    def join_place(self) -> Any:
        """(join_device, join_process_group) of the wrapped model."""
        group = self._r._link.group
        return join_device(group), group

    # -------------------------------------------------------- a step's calls
    def run_per_replica(self, fns: Sequence[Callable[[], Any]], what: str) -> List[Any]:
        """fns[r]() on replica r's worker (in parallel under wrap)."""
        return self._r._run_per_replica(fns, what)

    def work_name(self, kind: str, owner: Any) -> str:
        """`kind` as `owner`'s (an optimizer's state), numbered from the
        second live one on this model ("optimizer step 2"; a dropped one's
        number is taken again): run_replicas="auto" alternates its trials
        per kind, so two optimizers under one name would each be timed one
        way only."""
        owners = self._r.__dict__.setdefault("_work_owners", {}).setdefault(kind, [])
        free = [i for i, ref in enumerate(owners) if ref() is None]
        n = free[0] if free else len(owners)
        owners[n : n + 1] = [weakref.ref(owner)]
        return kind if n == 0 else f"{kind} {n + 1}"

    def runs_in_turn(self, what: str, settled: bool = True) -> bool:
        """Whether run_per_replica runs `what` one replica after another
        from now on (wrap's run_replicas: "in_turn", or "auto" once chosen),
        or else (not `settled`) at its next run, a trial of "auto" included."""
        return self._r._in_turn(what, settled)

    def check_step(self) -> None:
        r = self._r
        if open_backward(r):
            raise RuntimeError(
                "pyddp: cannot step: a backward did not finish, so its gradients are not "
                "reduced: it was cut short (Ctrl-C), or ran through dmodel.module(...) alone "
                "(replica 0 only); call zero_grad() (which drops it) and run the step again "
                "through dmodel(...)"
            )
        r.check_step()
        self._follow_unreduced()

    def before_clip(self) -> None:
        """dmodel.clip_grad_norm_: the gradients as the step would see them
        (check_step: assigned ones copied in, replicas aligned), and the
        slices of those set to None read zero (the norm sums buckets)."""
        try:
            self.check_step()
        except RuntimeError as e:  # (the reasons name the step)
            if type(e) is not RuntimeError:
                raise
            raise RuntimeError(str(e).replace("cannot step:", "cannot clip:", 1)) from None
        if self._r._engine is None:
            return  # (one replica: torch's clipping)
        if self._r._layout.scattered is not None:  # reconciled blocks; the placeholders
            self._r._layout.scattered.place()  # back on, so a reset after the clip counts
            return
        layout = self._r._layout
        grads = map(operator.attrgetter("grad"), layout.params[0])
        for i in [i for i, g in enumerate(grads) if g is None]:
            layout.zero_param(i)

    def _follow_unreduced(self) -> None:
        """Gradients replica 0 holds that no backward reduced since the last
        zero_grad() (assigned: DCP's get_optimizer_state_dict steps a fresh
        optimizer once on zeros to make its state) are every replica's: the
        others stepped without them, their state and values apart. Under
        shard="gradients" they go into the blocks (Scattered.take_assigned)."""
        if self._r._engine is None or self._r._layout._versions is not None:
            return
        layout = self._r._layout
        if layout.scattered is not None:  # the step reads the blocks alone
            layout.scattered.take_assigned()
            return
        for i, p in enumerate(layout.params[0]):
            g = p.grad
            for params in layout.params[1:]:
                params[i].grad = None if g is None else g.detach().to(params[i].device, copy=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A backward left open is dropped first (wrap's, where no finish() or
        abort() is the user's to call): cut short by Ctrl-C, or run through
        dmodel.module alone, which only replica 0's hooks saw. The replicas'
        queued work ends, then the engine's backward is aborted (across
        processes the others are told: their buckets would pair with the
        next step's)."""
        r = self._r
        if open_backward(r):
            r._run_per_replica([lambda: None] * len(r._replicas), "wait")
            r.abort("zero_grad() dropped a backward that did not finish (a Ctrl-C?)")
        r.zero_grad(set_to_none)


def open_backward(r: Any) -> bool:
    """Whether reducer `r` (checked open) holds a backward that did not
    finish; one replica in one process has no engine, and nothing open."""
    if r._engine is None:
        return False
    r._check_open()
    return bool(r._engine.active)
