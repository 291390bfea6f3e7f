"""The reducer: what a GradSync is inside, and the per-backward protocol
that `pyddp.wrap` drives (GradSync, sync.py, is the public face over it).
Built in one step from the parts params.assemble checked and connected (the
replicas, their GPU placement, the link, the work record): the link asked
once, the C++ engine, the bucket layout, the autograd hooks. Then, at every
step, one state machine:

    prepare(r) / prepare_all()  before a forward that may be followed by backward
    hooks: engine.mark_ready    during backward (hooks.py), reductions launching
    finish()                    end of backward: unused parameters settled, the
                                link's agreement waited for, gradients final
    check_step()                before an optimizer step
    zero_grad()                 after it
    no_sync() / shadow_backward() / abort() / reattach()   the detours
No "is there another process" branches: one process has a link that does nothing.
The model drives it (faces.ReplicaDriver), the optimizers see `gradients()`."""

from __future__ import annotations

import contextlib
import time
import weakref
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from ..errors import ProcessGroupError, ReduceError
from ..runtime.libraries import make_backend
from . import ending
from . import params as checked
from .ending import final_gradients, gradients_cleared, raised_at_finish, settle_unmarked
from .faces import GradientShards
from .hooks import arm_began, install_hooks
from .observe import GpuClock, Observer
from .plan import Plan, resolve_hook
from .streams import StepCapture, StreamOrder


class Reducer:
    """Reduces the gradients of N identical replicas during backward; see
    GradSync for the contract. `prepare_on_forward`: a forward pre-hook on
    each replica prepares it (GradSync); wrap prepares every replica itself."""

    def __init__(
        self,
        parts: checked.Parts,
        *,
        prepare_on_forward: bool,
        run_per_replica: Optional[Callable[[Sequence[Callable[[], Any]], str], List[Any]]] = None,
        in_turn: Optional[Callable[[str, bool], bool]] = None,
        on_backward_start: Optional[weakref.WeakMethod] = None,
    ):
        """`parts`: params.assemble's (its owner keeps the link and the work
        record). `run_per_replica`: one function per replica (wrap's workers;
        in turn if None); `in_turn(what, settled)`: GradientShards.runs_in_turn.
        `on_backward_start` (wrap's, one replica per process): a weak method
        the hooks call, so a backward past the outputs ends with finish()."""
        self._options = opts = parts.options
        self._replicas = replicas = parts.replicas
        self._names, self._params, self._devices = parts.names, parts.params, parts.devices
        self._gpu_devices, self._streams = parts.gpu_devices, parts.streams
        self._order = StreamOrder(self._gpu_devices, self._streams)
        self._clock = GpuClock(self._streams, self._gpu_devices)  # GPUs: is the host the bound?
        self._capture = StepCapture()  # GPUs: a backward captured into a CUDA graph
        self._engine: Optional[Any] = None
        self._closed = self.carried = False  # carried: see _clear_reduced_copy
        self._shadowing = False  # shadow_backward() under way
        self._finish_called_ns = 0
        self._handles: List[Any] = []
        # Run when close() is called or this object is dropped: removes the
        # hooks (which hold the engine, not this object) and closes the engine.
        self._finalizer = weakref.finalize(self, _release, self._handles, None)
        self._run_per_replica = run_per_replica or (lambda fns, what: [fn() for fn in fns])
        self._in_turn = in_turn or (lambda what, settled: run_per_replica is None)
        self._on_backward_start = on_backward_start
        self._observer = Observer(opts.keep())
        self._link, self._work = parts.link, parts.work
        places = self._gpu_devices or self._devices
        reduction = self._link.attach(
            self._work,
            len(replicas),
            opts.op,
            parts.gpu,
            # Held by the engine too: runtime/libraries.py closes every live
            # backend at interpreter exit.
            lambda rendezvous: make_backend(places, opts.timeout_s, rendezvous),
        )
        if reduction is None:
            return  # one replica in one process: nothing to reduce, stay out of the way
        self._backend, self._op, self._post_scale = reduction
        self._engine, self._layout, self._plan = Plan.build(
            self._names, self._params, opts, self._backend, self._op, self._order, self._link
        )
        first = self._params[0]
        for i in range(len(first)):
            if any(ps[i].grad is not None for ps in self._params):
                self._engine.note_grad(i, True)
        self._engine.set_timeline(self._observer.keep > 0)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, self._handles, self._engine)
        began = on_backward_start is not None
        install_hooks(self, self._handles, began, prepare_on_forward)
        arm_began(self)
        checked.note_synced(self, self._params)

    # ----------------------------------------------------------------- state
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def sharded(self) -> bool:
        """Whether the buckets are reduce-scattered (shard='gradients')."""
        return self._engine is not None and self._engine.scatter_ranks > 0

    def gradients(self) -> GradientShards:
        """The view the optimizers (optim/) get of this reducer."""
        return GradientShards(self)

    @property
    def reduces(self) -> bool:
        """False for one replica in one process, where nothing is reduced."""
        return self._engine is not None

    @property
    def syncing(self) -> bool:
        """Whether the next backward reduces (False under no_sync())."""
        return self._engine is None or self._engine.sync_enabled

    @property
    def adopted(self) -> int:  # gradients that arrived outside the buckets and were copied in
        return 0 if self._engine is None else self._layout.adopted

    def grads_moved(self, assigned: bool = True) -> bool:
        """Replica 0's gradients left their views (new storage, `assigned`): reattach()."""
        return self._engine is not None and self._layout.moved(assigned)

    @property
    def buckets(self) -> List[List[int]]:
        one = [range(len(self._names))] if self._engine is None else None
        return [list(b) for b in one or self._engine.buckets]

    def flat_grads(self, replica: int) -> List[Any]:
        if self._engine is None:  # the gradients themselves: in-place ops must reach them
            return [p.grad for p in self._params[replica] if p.grad is not None]
        if self._layout.scattered is not None:  # sharded gradients: the reduced blocks
            return list(self._layout.scattered.blocks[replica])
        return list(self._layout.flat[replica])

    # ------------------------------------------------------------- iteration
    def prepare(self, replica: int) -> None:
        """Before replica `replica` accumulates again (its forward pre-hook): after a
        reduction every replica holds the same sum, so replicas but 0 clear theirs."""
        if self._engine is None:
            return
        self._check_open()
        captured = self._capture.at_prepare(self, replica)  # raises what it cannot hold
        # Backward and the zeroing below run on this stream, after the reductions.
        self._order.use_current(self._engine, replica, captured)
        if self._layout.hot is not None:  # C++ hooks on the accumulators there are now
            self._layout.hot.refresh(replica)
        if self._engine.failed and gradients_cleared(self._layout):
            self._engine.clear_failed()  # torch's zero_grad, or one per part of the model
        self._follow_resets(forward=True)
        self._clear_reduced_copy(replica)

    def compare_settings(self) -> None:
        """GradSync's forward: what the ranks must share, compared if due."""
        if self._engine is not None and self._engine.sync_enabled:
            self._link.compare_due()

    def _follow_resets(self, forward: bool = False) -> None:
        # Every replica keeps a copy of the last reduction (op="avg": the mean), or
        # placeholders tell the user's resets (sharded gradients: read as backward
        # starts, so resets after the forward count; scattered.Scattered.guard).
        if self._engine.scatter_ranks or self._op == "avg":
            guard = self._on_backward_start is not None  # a backward may skip the outputs
            self._layout.follow_resets(self._engine, forward, guard)

    def _clear_reduced_copy(self, replica: int, fence: bool = False) -> None:
        """Drops replica `replica`'s copy of the last reduction, if it holds one.
        Sum: replica 0's copy alone carries the previous sum into the next one
        (`carried`: read by dmodel.loss's weighing across processes). Average:
        every copy does. `fence`: order the current stream after the reductions."""
        held = self._engine.take_reduced_copy(replica)
        if replica == 0 and self._link.spans_processes:
            self.carried = held and self._layout.any_gradient(0)
        if self._layout.scattered is not None:
            return  # sharded gradients: no bucket outlives its reduction (scattered.py)
        if not (held and replica > 0 and self._op == "sum"):
            return
        if fence:
            self._order.use_current(self._engine, replica, self._capture.active)
        self._layout.zero(replica, copy_dropped=True)

    def restart_accumulation(self, params_moved: Callable[[], Set[int]]) -> None:
        """At the start of a backward: the user's resets since the forward or
        within a no_sync() accumulation are followed (ending.Window: `params_moved`); replicas
        whose copy of the last reduction is still there (retain_graph=True, no
        forward between) clear it, as prepare does: the sum stays exact."""
        if self._engine is None:
            return
        self._layout.window.follow_resets(self._layout, params_moved)
        self._follow_resets()
        for r in range(len(self._replicas)):
            self._clear_reduced_copy(r, fence=True)

    def prepare_all(self) -> None:
        """Before a step that drives every replica from one thread: drops a
        backward that failed without abort(), then prepares every replica."""
        if self._engine is None:
            return
        self._link.check_usable()
        if self._engine.active:
            self._capture.drop(self._engine)  # the engine's backward aborted, no capture
            self._link.abandon_unfinished()
        for r in range(len(self._replicas)):
            self.prepare(r)
        arm_began(self)

    def finish(self) -> None:
        """GradSync.finish (its docstring is the contract)."""
        if self._engine is None:
            return
        # Autograd is done: what follows counts as finish, not backward compute.
        self._finish_called_ns = time.monotonic_ns()
        synced = self._engine.sync_enabled
        captured = self._capture.at_finish(self)  # raises what a replay could not redo
        if not synced:  # a micro-batch the next synced backward's record counts
            self._work.backward_done()
        # Unmarked slices are reconciled on the current streams, their
        # reductions waiting for them and they for the reductions.
        streams = self._order.current()
        if not captured:  # (captured: the host writes nothing)
            self._order.fence_all()
        for r in range(1, len(self._replicas)):  # (no forward since: not summed again)
            self._clear_reduced_copy(r)
        launched: List[int] = []
        unused: List[int] = []
        factor: Any = 1.0
        try:
            settle_unmarked(  # across processes, may hear that a peer failed
                self._engine, self._layout, self._link, self._work, self._shadowing
            )
            no_grad, reduced_partly = self._engine.finish(streams)
            if synced:
                launched, unused, factor = self._wait_for_link()
        except Exception as e:
            error = raised_at_finish(self._link, e, synced)
            if error is e:
                raise
            raise error from e
        finally:
            if not self._capture.ended():
                self._observe()
        final_gradients(
            self._engine,
            self._layout,
            self._order,
            synced,
            no_grad,
            reduced_partly,
            launched,
            unused,
            self._post_scale,
            factor,
        )
        if synced:
            self._plan.rebuild_once()
        self._layout.mark_reduced()
        arm_began(self)

    def shadow_backward(self) -> None:
        """Under torch's Join, on a rank whose inputs ran out: takes part in
        a synced backward of the ranks that still have inputs, with zero
        gradients and no part in the agreement (pyddp.wrap's join hook calls
        it). The buckets launch as in any backward (the same ones, in the
        same order, through a communication hook if one is registered);
        afterwards this rank's gradients are what they were before (torch
        DDP's shadowing leaves .grad alone): the reductions it took part in
        are the other ranks' steps, and a first step after Join must not add
        them in again."""
        if self._engine is None or not self._link.spans_processes:
            return
        if not self._engine.sync_enabled:
            raise RuntimeError(
                "pyddp: a rank that joined (torch's Join) is under no_sync(): it must shadow "
                "the other ranks' synced backward; leave no_sync() before the Join block ends"
            )
        self.prepare_all()
        self._order.fence_all()  # the copies read after any reduction still writing
        kept = self._layout.keep(self._engine)
        self.zero_grad(set_to_none=True)  # every gradient absent here: zeros on the wire
        self._shadowing = True
        try:
            self.finish()
        finally:
            self._shadowing = False
            self._order.fence_all()  # after the shadowed reductions
            self._layout.put_back(self._engine, kept)

    def _wait_for_link(self) -> Tuple[List[int], List[int], Any]:
        try:
            return self._link.wait()
        except ProcessGroupError as e:
            self._engine.abort()
            raise ReduceError(str(e)) from None

    def note_forward_end(self) -> None:
        """Marks the end of the forward whose backward comes next (the start of
        DDP's "backward compute"); wrap calls it for you."""
        if self._engine is not None:
            self._engine.note_forward_end()
            self._link.forward_ended(self._engine.sync_enabled)

    def abort(self, reason: str = "abort() after a backward raised") -> None:
        """GradSync.abort (its docstring is the contract)."""
        self._capture.reset()  # (a step that raised inside a capture: over)
        if self._engine is not None:
            self._engine.abort()
            arm_began(self)
        self._link.abandon(reason)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """GradSync.zero_grad (its docstring is the contract)."""
        if self._engine is None:
            for p in self._params[0]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            return
        self._check_open()
        # GPUs: the current streams after the reductions (what touches the
        # buckets next runs there); a dead context says so here.
        for r in range(len(self._replicas)):
            self._order.use_current(self._engine, r)
        if set_to_none:  # (no write to the buckets: the next gradients are copied in)
            self._layout.hand_over()
        else:
            self._run_per_replica(
                [partial(self._layout.zero, r) for r in range(len(self._replicas))], "zero_grad"
            )
            ending.zeroed_in_place(self._layout)
        self._engine.clear_grads(set_to_none)
        self._layout.forget_reduced()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """GradSync.no_sync (its docstring is the contract)."""
        if self._engine is None:
            yield
            return
        previous = self._engine.sync_enabled
        self._engine.set_sync(False)
        try:
            yield
        finally:
            self._engine.set_sync(previous)

    def check_step(self) -> None:
        """GradSync.check_step (its docstring is the contract)."""
        if self._engine is None:
            return
        self._check_open()
        if self._engine.active:
            raise RuntimeError(
                "pyddp: cannot step: a backward ran but finish() was not called, so its "
                "gradients are not fully reduced; call finish() once every replica's backward "
                "has returned (abort() and zero_grad() if one raised)"
            )
        try:
            self._engine.check()
        except ReduceError as e:
            raise ReduceError(f"{e}; call zero_grad() and run the step again") from None
        if self._engine.partial:
            raise RuntimeError(f"pyddp: cannot step: {self._engine.partial_reason}")
        self._layout.align()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("pyddp: this GradSync (or wrapped model) was closed")

    def reattach(self, params_moved: Optional[Callable[[], Set[int]]] = None) -> None:
        if self._engine is None:
            return
        self._check_open()
        self._plan.reattach(params_moved)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        if self._engine is None:  # one replica in one process: the link says it is unused
            self._link.register_comm_hook(state, resolve_hook(hook))
            return
        self._check_open()
        used = self._observer.last is not None or self._engine.active
        self._plan.register_comm_hook(state, hook, self._gpu_devices is not None, used)

    # ------------------------------------------------------------ statistics
    def _observe(self) -> None:
        self._clock.end()  # after the reductions' waits were queued (engine.finish)
        self._observer.observe(self._engine, self._link, self._layout, self._finish_called_ns)

    def reset_stats(self) -> None:
        """Forgets the running means (a benchmark's warm-up)."""
        self._observer.reset()
        self._clock.reset()

    def stats(self) -> Dict[str, Any]:
        out = self._observer.stats(self.adopted, len(self.buckets), self._engine is not None)
        return {**out, **self._capture.report(), **self._clock.report()}

    def export_timeline(self, path: Any) -> Any:
        if self._engine is None:
            raise RuntimeError("one replica: there is no communication to trace")
        rank, n = (self._link.rank if self._link.spans_processes else None), len(self._replicas)
        return self._observer.export(path, self._names, self._engine.buckets, n, rank)

    def ready_times(self) -> Any:
        return self._observer.ready_times(self._names, self._params[0])

    # ------------------------------------------------------------- lifecycle
    def close(self, settle: bool = True) -> None:  # settle=False: when its wrapper is collected
        if self._closed:
            return
        self._closed = True
        settle = settle and self._engine is not None and self._link.spans_processes
        try:
            if settle and self._link_usable():
                self._link.settle()
        finally:
            self._finalizer()

    def _link_usable(self) -> bool:
        try:
            return self._link.check_usable() or True
        except ProcessGroupError:
            return False  # it failed already, and said so where it happened

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a GradSync (or a wrapped model) holds threads and communicators and cannot be "
            "pickled or copied; save or copy the model (dmodel.module) and wrap the copy"
        )


def _release(handles: List[Any], engine: Optional[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()
    if engine is not None:
        engine.close()
