"""Uneven inputs across processes: a wrapped model is one of torch's
Joinables, so torch's Join context manager (or `dmodel.join()`, as on torch
DDP) lets ranks whose data ran out early shadow the others' collectives
until every rank is done, instead of failing at the timeout.

While a rank has inputs, each of its forwards under Join tells torch's Join
it has not joined (torch's own all-reduce on the caller's process group),
then makes pyddp's exchange of the step (_link/joining.py): which ranks
still have inputs, whether they broadcast buffers and run a synced backward
after this forward, and the global batch's rows. A joined rank's join hook
makes the same exchange and shadows exactly that: the buffer broadcast (from
the highest rank with inputs, as torch DDP) and the synced backward with zero gradients
(GradSync.shadow_backward). Once every rank has joined, the highest of the
last ranks to join sends its parameters, buffers and step counters to every
other rank (torch DDP's choice), since the joined ranks did not step, and
the state of the optimizers dmodel.optimizer made with their schedulers
(optim/after_join.py), which torch DDP leaves apart.

Gradients: averaged over every rank with the joined ones adding zeros
(torch DDP's divide_by_initial_world_size=True), or over the ranks with
inputs (False). dmodel.loss weighs the rows that exist, which is the mean
over the global batch either way.

A sharded optimizer (shard=True: ZeRO stage 1) steps on every rank, the
joined ones too: each owns a shard no other rank steps. Its step is an
iteration of torch's Join of its own (announced as a forward is), and the
highest rank with inputs sends the optimizer's settings and, once a rank
has joined, the gradients it steps with (whatever was done to them since
the backward: clipping, GradScaler's unscale_), with which a joined rank
steps its shard: every rank's parameters and shard state stay the closed
form's."""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Dict, Iterator, List, Optional, Protocol, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from .._link import Link
from .._link.control import BUFFERS_BROADCAST
from .._link.joining import JOIN_ARGUMENTS, JOIN_GRADIENTS, JOIN_SETTINGS, join_device
from .._link.joining import Joining as JoinState
from ..engine.faces import ReplicaDriver
from ..errors import ReduceError, ReplicaError, TrainingError
from ..optim.after_join import align_optimizers
from ..optim.base import AMP_STEP
from ..optim.shards import hyper_of
from ..optim.zero import ShardedState, step_parameters
from .steps import StepFlags
from .syncbn import SyncBatchNorms

_OWN = (ReduceError, ReplicaError, TrainingError)  # pyddp's errors name their cause
# Wrapped models whose join hook torch's Join made, until they leave it.
_IN_JOIN: weakref.WeakSet[Any] = weakref.WeakSet()
STAGE2_UNDER_JOIN = (
    "pyddp: shard='gradients' (ZeRO stage 2) under Join is not supported yet: a rank that "
    "joined would have to shadow the reduce-scatters; use shard=True (ZeRO stage 1, which "
    "steps under Join) or shard=False"
)


class JoiningHost(Protocol):
    """What Joining reads of the DistributedModel it is mixed into (model.py)
    and does not define itself; _ShadowHook and the end of Join also read
    `m.module`, `m._copy_buffers` and `m._work` of the model they shadow."""

    _reducer: ReplicaDriver
    _link: Link
    _join: JoinState  # the link's Join state and exchanges (_link/joining.py)
    _syncbn: Optional[SyncBatchNorms]
    _flags: StepFlags  # the running step's (steps.py)
    ranks: Any  # this model's control exchanges (Ranks)
    _apart_after_join: str  # why training is refused after Join ("" if not)

    def _check_open(self) -> None: ...
    def _optimizers_made(self) -> List[torch.optim.Optimizer]: ...


class Joining(Joinable):
    """The Joinable side of DistributedModel (which calls `Joinable.__init__`
    and `_join_forward` / `_notify_join` from its forward)."""

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> contextlib.AbstractContextManager:
        """torch DDP's `join()`: a context manager around the training loop
        in which ranks with fewer batches than others shadow the others'
        steps instead of failing. `divide_by_initial_world_size`: gradients
        averaged over every rank (True, torch's default) or over the ranks
        that still have inputs (False); with dmodel.loss the gradient is the
        global batch's mean either way. `throw_on_early_termination`: every
        rank raises RuntimeError once one runs out (torch's behaviour), and
        the model stays usable. In one process there is nothing to join.

        Usage, as with torch DDP: `with dmodel.join(): for x, y in
        my_loader: ...`, or torch's `Join([dmodel, ...])`. The context this
        returns makes torch's Join on entering and leaves the model as it was
        before on a normal exit or torch's throw_on_early_termination error
        (torch's Join alone does not when the block raises). Any other
        exception leaving the block is told to the other ranks, which raise
        ProcessGroupError, and this rank's model refuses further steps:
        restart the processes. The arguments are compared across ranks when
        join() is called (every rank must call it)."""
        for name, value in (
            ("divide_by_initial_world_size", divide_by_initial_world_size),
            ("enable", enable),
            ("throw_on_early_termination", throw_on_early_termination),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"join(): {name} must be a bool, got {type(value).__name__}")
        self._check_open()
        if not self._link.spans_processes:
            return contextlib.nullcontext()  # nothing to join
        # Ranks entering with other arguments would average otherwise, or
        # wait for each other until the timeout: named on every rank.
        mine = (enable, divide_by_initial_world_size, throw_on_early_termination)
        every = self.ranks.gather(mine, JOIN_ARGUMENTS)
        if any(args != every[0] for args in every):
            names = ("enable", "divide_by_initial_world_size", "throw_on_early_termination")
            told = "; ".join(
                f"rank {r}: " + ", ".join(f"{n}={v}" for n, v in zip(names, args))
                for r, args in zip(self.ranks.global_ranks, every)
            )
            raise _alike(
                f"pyddp: the ranks entered join() with different arguments ({told}); every "
                "rank must pass the same"
            )
        if not enable:
            return contextlib.nullcontext()  # nothing to join
        return self._joined(enable, throw_on_early_termination, divide_by_initial_world_size)

    @contextlib.contextmanager
    def _joined(self, enable: bool, throw: bool, divide: bool) -> Iterator[None]:
        # torch's Join enables its joinables when made: made on entering, so
        # a join() never entered changes nothing.
        join = Join(
            [self],
            enable=enable,
            throw_on_early_termination=throw,
            divide_by_initial_world_size=divide,
        )
        join.__enter__()
        try:
            try:
                yield
            except BaseException as e:
                join.__exit__(*sys.exc_info())  # torch's: returns at once on an error
                if not _torch_throw(e) and not getattr(e, "_pyddp_alike", False):
                    # The others, still in Join, would pair their steps with
                    # whatever this rank does next, or wait for it until the
                    # timeout: told now, as a backward that raised tells them.
                    self._link.abandon(f"{type(e).__name__} left its join() block: {e}")
                raise
            # The block is done: torch's Join waits for the other ranks with
            # all-reduces of its own, named if a rank dies or stops meanwhile.
            what = "torch's Join, waiting for the ranks that still have inputs"
            self._guarded(what, join.__exit__, None, None, None)
        finally:
            self._leave_join()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """torch's Joinable: the hook a joined rank runs for each step of
        the others (kwargs: divide_by_initial_world_size, default True)."""
        self._check_open()
        if not self._link.spans_processes:
            raise RuntimeError(
                "pyddp: Join needs processes to join: this wrapped model runs in one process "
                "(dmodel.join() is a no-op there)"
            )
        if self._apart_after_join:  # here too: a rank without batches makes no forward
            raise RuntimeError(self._apart_after_join)
        if self._syncbn is not None:
            raise NotImplementedError(
                "pyddp: Join with SyncBatchNorm layers is not supported (nor by torch DDP): "
                "a joined rank cannot know how many statistics exchanges the others make; "
                "give every rank the same number of batches, or use BatchNorm"
            )
        if self._reducer.gradients().gradients_sharded:
            raise NotImplementedError(STAGE2_UNDER_JOIN)
        others = [m for m in _IN_JOIN if m is not self and not m._reducer.closed]
        for m in others:
            if not m._join_config.enable:  # its hook made by this same Join, which fails
                m._leave_join()
        if others:
            raise _alike(
                "pyddp: two wrapped models under Join at once (torch's Join([a, b]), or one's "
                "join() inside the other's): a rank that ran out of inputs shadows one model's "
                "step at a time, while the ranks with inputs interleave both models' "
                "exchanges, so they would wait on each other until the timeout. Wrap the "
                "models as one module (one pyddp.wrap). (A torch Join left by an exception "
                "leaves its model joined; dmodel.join() leaves it however the block ends.)"
            )
        _IN_JOIN.add(self)
        divide = kwargs.get("divide_by_initial_world_size", True)
        if not isinstance(divide, bool):
            raise TypeError("divide_by_initial_world_size must be a bool")
        announce = weakref.WeakMethod(self._announce_sharded_step)
        hooked = self._link.hook[0] is not None  # (no divisor then: Joining.hook_divides)
        self._join.enter(not divide, lambda opt: announce()(opt), hooked)  # type: ignore[misc]
        return _ShadowHook(self)

    @property
    def join_device(self) -> torch.device:
        """torch's Joinable: where Join's own all-reduces live (the CPU for
        gloo, this process's GPU for NCCL)."""
        return join_device(self._link.group)

    @property
    def join_process_group(self) -> Any:
        """torch's Joinable: the process group this model spans (Join's own
        all-reduces run there, as torch DDP's do on its group)."""
        return self._link.group

    # ------------------------------------------------ from DistributedModel
    def _notify_join(self) -> None:
        """At the start of every forward: tells torch's Join this rank has
        inputs. With throw_on_early_termination it raises once a rank has
        joined, before anything of this step happened (the model stays
        usable)."""
        if self._join_config.enable:
            what = "torch's Join, saying this rank still has inputs"
            self._guarded(what, Join.notify_join_context, self)

    def _guarded(self, what: str, fn: Any, *args: Any) -> None:
        """fn(*args), torch's Join's own collectives: a rank that died or
        stopped meanwhile is named (not gloo's "Connection reset" or its
        timeout); throw_on_early_termination's own error passes as torch
        raises it (the model stays usable)."""
        try:
            fn(*args)
        except RuntimeError as e:
            if isinstance(e, _OWN) or _torch_throw(e):
                raise  # pyddp's, already named (a shadowed step), or torch's throw
            self._join.name_failure(what, e)

    def _join_forward(self, rows: int) -> None:
        """Under Join, before the buffer broadcast of a forward: pyddp's
        exchange of the step (what the joined ranks shadow)."""
        if not self._join_config.enable:
            return
        grad = torch.is_grad_enabled()
        self._join.exchange_step(
            True,
            grad and self._flags.buffers_due,
            grad and self._reducer.syncing,
            float(rows),
        )

    def _announce_sharded_step(self, optimizer: Any) -> None:
        """Under Join, on a rank with inputs, before a sharded optimizer
        steps: one more iteration for the joined ranks (torch's Join
        all-reduce, then pyddp's exchange naming the optimizer); the highest
        rank with inputs sends its settings and gradients (_step_inputs)."""
        place = next((k for k, o in enumerate(self._optimizers_made()) if o is optimizer), None)
        if place is None:  # not dmodel.optimizer's: its shards' owners could not be told
            raise RuntimeError(
                "pyddp: under Join, a sharded optimizer must be one this wrapped model made "
                "(dmodel.optimizer(cls, shard=True, ...))"
            )
        self._notify_join()
        step = self._join.exchange_step(True, False, False, 0.0, place)
        assert step is not None  # across processes only (join_hook refuses one)
        grads = [p.grad for p in step_parameters(optimizer)]
        _step_inputs(self, optimizer, step.source, grads, len(step.active) < self.ranks.world)

    def _leave_join(self) -> None:
        """After Join, however it ended (torch's skips the join hooks' end
        when the block raised): no step exchange, rank 0's buffers, the
        rows dmodel.loss weighs exchanged again."""
        self._join_config = type(self._join_config).construct_disabled_join_config()
        self._flags.send_at_next = False  # (a rank that joined never answered its last forward)
        self._join.leave()
        _IN_JOIN.discard(self)


def _alike(message: str) -> RuntimeError:
    """A refusal every rank raises at the same point: nothing to tell the
    others when it leaves a join() block."""
    e = RuntimeError(message)
    e._pyddp_alike = True  # type: ignore[attr-defined]
    return e


def _torch_throw(e: BaseException) -> bool:
    """torch's Join's throw_on_early_termination error, raised on every rank."""
    return (
        isinstance(e, RuntimeError) and "exhausted" in str(e) and not isinstance(e, dist.DistError)
    )


class _ShadowHook(JoinHook):
    def __init__(self, model: Any):
        self.model = model

    def main_hook(self) -> None:
        """One step of the ranks with inputs, shadowed."""
        m = self.model
        m._check_open()
        step = m._join.exchange_step(False, False, False, 0.0)
        assert step is not None  # across processes only (join_hook refuses one)
        if step.optimizer is not None:
            self._shadow_step(step.optimizer, step.source)
            return
        if step.resend:  # at the forward, as the ranks with inputs (staged.py)
            m._link.broadcast(list(m.module.buffers()), BUFFERS_BROADCAST)
            m._copy_buffers()
        if step.syncs:
            m._reducer.shadow_backward()
        if step.broadcasts:  # after the backward, as the ranks with inputs
            m._link.broadcast(list(m.module.buffers()), BUFFERS_BROADCAST)
            m._link.joining.staged_from = step.source
            m._copy_buffers()

    def _shadow_step(self, place: int, source: int) -> None:
        """The ranks with inputs step the sharded optimizer at `place`
        among dmodel.optimizer's: this rank steps its shard too."""
        m = self.model
        made = m._optimizers_made()
        opt = made[place] if place < len(made) else None
        if opt is None or not isinstance(opt.__dict__.get("_pyddp"), ShardedState):
            m._join.refuse(
                f"under Join, the ranks with inputs step a sharded optimizer, number "
                f"{place + 1} of those dmodel.optimizer made, and this rank (joined) has "
                f"{'no such optimizer' if opt is None else 'an unsharded one there'}; every "
                "rank must make the same optimizers"
            )
        opt._pyddp_shadow_step(*_step_inputs(m, opt, source, None, True))

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank joined: every rank takes the last joiner's model."""
        m = self.model
        record = m._work
        steps = record.steps
        counters = torch.tensor([record.steps, record.backwards_since_sync], dtype=torch.int64)
        state: List[torch.Tensor] = list(m.module.parameters()) + list(m.module.buffers())
        source = m._join.end(is_last_joiner, [t.detach() for t in state] + [counters])
        record.steps, record.backwards_since_sync = (int(v) for v in counters.tolist())
        m.sync_replicas()
        try:
            m._apart_after_join = align_optimizers(  # and schedulers
                m._optimizers_made(), record.stepping(), m.ranks, source, steps
            )
        finally:
            m._leave_join()


def _step_inputs(
    m: Any, optimizer: Any, source: int, grads: Optional[List[Any]], joined: bool
) -> Tuple[List[dict], List[Any], Dict[str, Any]]:
    """Under Join, at a sharded optimizer's step, on every rank: rank
    `source`'s settings (each param group's hyper-parameters, and what
    GradScaler set for a fused optimizer's step) and, if a rank has
    `joined`, the gradients it steps with (None where it has none; the
    others' `grads` are their own, or None on a joined rank)."""
    if not joined:  # nobody to tell
        return [], [], {}
    settings = [hyper_of(g) for g in optimizer.param_groups]
    amp = {n: optimizer.__dict__[n] for n in AMP_STEP if n in optimizer.__dict__}
    amp = {n: None if v is None else float(v) for n, v in amp.items()}  # (GPUs: read once)
    present = None if grads is None else [g is not None for g in grads]
    mine = (settings, present, amp)
    settings, present, amp = m.ranks.from_root(mine, JOIN_SETTINGS, root=source)
    sends = m.ranks.rank == source
    params = step_parameters(optimizer)
    travel = [
        (grads[k].contiguous() if sends else torch.empty(p.shape, dtype=p.dtype, device=p.device))
        if there
        else None
        for k, (p, there) in enumerate(zip(params, present))
    ]
    m._link.broadcast([t for t in travel if t is not None], JOIN_GRADIENTS)
    return settings, travel, amp
