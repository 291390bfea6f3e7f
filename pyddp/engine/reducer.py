"""The reducer: what a GradSync is inside, and the per-backward protocol
that `pyddp.wrap` drives (GradSync, sync.py, is the public face over it).
Built in one step (the replicas checked, the GPU placement, the link asked
once, the C++ engine, the bucket layout, the autograd hooks), then, at every
step, one state machine:

    prepare(r) / prepare_all()  before a forward that may be followed by backward
    hooks: engine.mark_ready    during backward (hooks.py), reductions launching
    finish()                    end of backward: unused parameters settled, the
                                link's agreement waited for, gradients final
    check_step()                before an optimizer step
    zero_grad()                 after it
    no_sync() / shadow_backward() / abort() / reattach()   the detours

It holds no "is there another process" branches: a single process has a link
that does nothing."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import Counter
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from torch import nn

from .. import _C
from .._link import WorkRecord, connect, resolve_group
from ..errors import ProcessGroupError, ReduceError
from ..runtime.libraries import make_backend
from . import params as checked
from .buckets import BucketLayout
from .comm_hooks import resolve_hook
from .hooks import install_hooks
from .observe import Observer
from .options import Options
from .placement import gpu_placement
from .plan import Plan, first_plan
from .streams import StreamOrder


class Reducer:
    """Reduces the gradients of N identical replicas during backward; see
    GradSync for the contract. `prepare_on_forward`: a forward pre-hook on
    each replica prepares it (GradSync); wrap prepares every replica itself."""

    def __init__(self, replicas: List[nn.Module], opts: Options, prepare_on_forward: bool):
        group = resolve_group(opts.group)
        self.options = opts = opts.in_group(group)
        self.replicas = replicas
        self.names, self.params = checked.trainable_params(replicas)
        checked.refuse_synced_twice(self.names, self.params)
        if opts.check_replicas:
            checked.check_identical(replicas)
        self.devices = [params[0].device for params in self.params]
        gpu = gpu_placement(self.devices, "GradSync")
        self.gpu_devices: Optional[List[int]] = None if gpu is None else gpu[0]
        self.streams: Optional[Any] = None if gpu is None else gpu[1]
        self.order = StreamOrder(self.gpu_devices, self.streams)
        self.engine: Optional[Any] = None
        self.closed = False
        self.shadowing = False  # shadow_backward() under way
        self.finish_called_ns = 0
        self.handles: List[Any] = []
        # Run when close() is called or this object is dropped: removes the
        # hooks (which hold the engine, not this object) and closes the engine.
        self.finalizer = weakref.finalize(self, _release, self.handles, None)
        # Runs one function per replica; wrap installs its parallel workers.
        self.run_per_replica: Callable[[Sequence[Callable[[], Any]], str], List[Any]] = _in_turn
        # wrap's, with one replica per process: a weak method the gradient
        # hooks call, so a backward that bypasses the wrapped model's outputs
        # still ends with finish() (hooks._began).
        self.on_backward_start: Optional[weakref.WeakMethod] = None
        self.observer = Observer(opts.keep())
        # The group says which ranks: pyddp reduces on gloo groups of its own
        # over them (and NCCL for GPUs), whatever the group's backend.
        self.link = connect(
            group,
            replicas,
            self.names,
            self.devices[0].type,
            opts.timeout_s,
            opts.op,
            opts.compared(),
            self.gpu_devices,
        )
        # Compared across processes at every synced backward (the agreement).
        self.work = WorkRecord(self.params[0], replicas[0], gpu is not None)
        places = self.gpu_devices or self.devices
        reduction = self.link.attach(
            self.work,
            len(replicas),
            opts.op,
            gpu,
            # Held by the engine too: runtime/libraries.py closes every live
            # backend at interpreter exit.
            lambda rendezvous: make_backend(places, opts.timeout_s, rendezvous),
        )
        if reduction is None:
            return  # one replica in one process: nothing to reduce, stay out of the way
        self.backend, self.op, self.post_scale = reduction
        first = self.params[0]
        dtypes = [checked.dtype_name(n, p) for n, p in zip(self.names, first)]
        buckets = first_plan(first, dtypes, opts)
        self.engine = _C.Engine(
            len(replicas),
            self.names,
            [p.numel() for p in first],
            dtypes,
            buckets,
            opts.reduce_order,
            self.op,
            self.backend,
        )
        self.layout = BucketLayout(
            self.params,
            dtypes,
            self.engine.set_buffer,
            self.gpu_devices,
            self.order.fence,
            self.order.zeros,
        )
        self.plan = Plan(self.engine, self.layout, self.order, self.link, first, self.backend, opts)
        self.plan.allocate(buckets)
        for i in range(len(first)):
            if any(ps[i].grad is not None for ps in self.params):
                self.engine.note_grad(i, True)
        self.engine.set_timeline(self.observer.keep > 0)
        self.finalizer.detach()
        self.finalizer = weakref.finalize(self, _release, self.handles, self.engine)
        # wrap with one replica per process may set on_backward_start; only
        # then do the hooks pay for the call (a Python call per gradient).
        began = len(replicas) == 1 and not prepare_on_forward
        install_hooks(self, self.handles, began, prepare_on_forward)
        checked.note_synced(self)

    # ----------------------------------------------------------------- state
    @property
    def reduces(self) -> bool:
        """False for one replica in one process, where nothing is reduced."""
        return self.engine is not None

    @property
    def syncing(self) -> bool:
        """Whether the next backward reduces (False under no_sync())."""
        return self.engine is None or self.engine.sync_enabled

    @property
    def adopted(self) -> int:
        """Gradients that arrived outside the buckets and were copied in."""
        return self.layout.adopted if self.engine is not None else 0

    def grads_moved(self) -> bool:
        """Whether replica 0's gradients left their bucket views (Module._apply
        replaced their storage, or a gradient was assigned): reattach() then."""
        return self.engine is not None and self.layout.moved()

    @property
    def buckets(self) -> List[List[int]]:
        if self.engine is None:
            return [list(range(len(self.names)))]
        return [list(b) for b in self.engine.buckets]

    def flat_grads(self, replica: int) -> List[Any]:
        if self.engine is None:  # the gradients themselves: in-place ops must reach them
            return [p.grad for p in self.params[replica] if p.grad is not None]
        if self.layout.scattered is not None:  # sharded gradients: the reduced blocks
            return list(self.layout.scattered.blocks[replica])
        return list(self.layout.flat[replica])

    # ------------------------------------------------------------- iteration
    def prepare(self, replica: int) -> None:
        """Called before replica `replica` accumulates again (its forward pre-hook
        does it): after a reduction every replica holds the same sum, so replicas
        other than 0 clear their copy, keeping sum-over-replicas exact."""
        if self.engine is None:
            return
        self.check_open()
        # Backward runs on the stream its forward runs on: this one. It and the
        # zeroing below come after the last reduction of these buckets.
        self.order.use_current(self.engine, replica)
        self._follow_resets()
        self._clear_reduced_copy(replica)

    def _follow_resets(self) -> None:
        # Every replica keeps a copy of the last reduction (op="avg": the
        # mean), or its placeholders tell the user's resets (sharded gradients).
        if self.engine.scatter_ranks or self.op == "avg":
            self.layout.follow_resets(self.engine)

    def _clear_reduced_copy(self, replica: int, fence: bool = False) -> None:
        """Drops replica `replica`'s copy of the last reduction, if it holds
        one. Sum: replica 0's copy alone carries the previous sum into the
        next one. Average: every copy does (each holds the mean, and the next
        mean of (mean + new) is mean + new mean). `fence`: order the current
        stream after the reductions first (prepare has done it already)."""
        held = self.engine.take_reduced_copy(replica)
        if self.layout.scattered is not None:
            return  # sharded gradients: no bucket outlives its reduction (scattered.py)
        if not (held and replica > 0 and self.op == "sum"):
            return
        if fence:
            self.order.use_current(self.engine, replica)
        self.layout.zero(replica)

    def restart_accumulation(self) -> None:
        """At the start of a backward: replicas whose copy of the last
        reduction is still there (a second backward over a graph kept with
        retain_graph=True, with no forward in between) clear it, as prepare
        does, so the sum over replicas stays exact."""
        if self.engine is None:
            return
        self._follow_resets()
        for r in range(len(self.replicas)):
            self._clear_reduced_copy(r, fence=True)

    def prepare_all(self) -> None:
        """Before a step that drives every replica from one thread: drops a
        backward that failed without abort(), then prepares every replica."""
        if self.engine is None:
            return
        self.link.check_usable()
        if self.engine.active:
            self.engine.abort()
            self.link.abandon_unfinished()
        for r in range(len(self.replicas)):
            self.prepare(r)

    def finish(self) -> None:
        """GradSync.finish (its docstring is the contract)."""
        if self.engine is None:
            return
        # Autograd is done here: what follows (settling unused parameters, the
        # agreement across processes) counts as finish, not backward compute.
        self.finish_called_ns = time.monotonic_ns()
        synced = self.engine.sync_enabled
        if not synced:  # a micro-batch the next synced backward's record counts
            self.work.backward_done()
        # Unmarked slices are reconciled on the current streams; their
        # reductions wait for them, and they wait for the reductions.
        streams = self.order.current()
        self.order.fence_all()
        launched: List[int] = []
        unused: List[int] = []
        factor: Any = 1.0
        try:
            self._settle_unmarked()  # across processes, may hear that a peer failed
            no_grad, reduced_partly = self.engine.finish(streams)
            if synced:
                launched, unused, factor = self._wait_for_link()
        except Exception as e:
            hook_error = self.link.hook_error()
            if hook_error is not None:
                # The user's communication hook raised: its own exception,
                # with its type, pyddp's account of it chained as the cause.
                raise hook_error from e
            if synced and not isinstance(e, ProcessGroupError):
                # A local failure after this rank's reductions were launched:
                # the other processes hear it now instead of at the timeout.
                self.link.abandon(f"its end of backward raised {type(e).__name__}: {e}")
            raise
        finally:
            self.observe()
        for i in no_grad:
            self.layout.grads_to_none(i)
        for i in reduced_partly:
            self.layout.point_grads(i)
        # Reduced across processes through replica 0's buffers (already
        # divided by the number of processes): the other replicas get them.
        self.layout.copy_to_others(launched)
        for i in unused:  # no gradient on any process: None, as on one device
            self.engine.note_grad(i, False)
            self.layout.grads_to_none(i)
        if synced and self.post_scale != 1.0:
            # NCCL summed over every process's GPUs: average over processes.
            # On the caller's streams, which finish() ordered after the
            # reductions (no host wait on a GPU).
            self.order.fence_all()
            self.layout.scale(self.post_scale)
        if isinstance(factor, list) or factor != 1.0:
            # dmodel.loss weighed on the rows assumed across processes: the
            # global batch's own (a float, or per replica on its GPU).
            self.order.fence_all()
            self.layout.scale(factor)
        if synced and self.layout.scattered is not None:
            self.order.fence_all()  # the copies out read the reductions' results
            self.layout.scattered.release_all()
            self.layout.scattered.after_backward(self.engine.has_grad)
        if synced:
            self.plan.rebuild_once()
        self.layout.mark_reduced()

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
        if self.engine is None or not self.link.spans_processes:
            return
        if not self.engine.sync_enabled:
            raise RuntimeError(
                "pyddp: a rank that joined (torch's Join) is under no_sync(): it must shadow "
                "the other ranks' synced backward; leave no_sync() before the Join block ends"
            )
        self.prepare_all()
        self.order.fence_all()  # the copies read after any reduction still writing
        kept = self.layout.keep(self.engine)
        self.zero_grad(set_to_none=True)  # every gradient absent here: zeros on the wire
        self.shadowing = True
        try:
            self.finish()
        finally:
            self.shadowing = False
            self.order.fence_all()  # after the shadowed reductions
            self.layout.put_back(self.engine, kept)

    def _wait_for_link(self) -> Tuple[List[int], List[int], Any]:
        try:
            return self.link.wait()
        except ProcessGroupError as e:
            self.engine.abort()
            raise ReduceError(str(e)) from None

    def _settle_unmarked(self) -> None:
        """Parameters some replica produced no gradient for. A replica that
        produced none contributes its bucket slice as is (or zero, if its
        grad was reset behind pyddp's back). A parameter produced by no
        replica whose canonical copy (replica 0) is None stays None
        everywhere, as on one device; across processes every rank must
        launch the same buckets, so such parameters are reduced with zeros
        while the link agrees which have a gradient on no process at all
        (those return to None after the reductions)."""
        unmarked = self.engine.unmarked()
        nowhere = {i for i, n in Counter(i for _, i in unmarked).items() if n == len(self.replicas)}
        none_here = {i for i in nowhere if self.layout.no_gradient(i)}
        for i in nowhere - none_here:  # set by hand, unused: kept (one device, torch DDP)
            self.engine.note_grad(i, True)
        if self.engine.sync_enabled:
            absent = sorted(none_here)
            agreeing = self.link.start_agreement(
                absent, len(self.names), self.work.take, self.shadowing
            )
            for i in agreeing:
                self.engine.note_grad(i, True)
                self.layout.zero_param(i)
                none_here.discard(i)
        for i in sorted(none_here):
            self.engine.note_grad(i, False)
            self.layout.zero_param(i)  # None slices read zero (clipping sums buckets)
        for r, i in unmarked:
            self.layout.take_in(r, i)

    def note_forward_end(self) -> None:
        """Marks the end of the forward whose backward comes next (the start of
        DDP's "backward compute"); wrap calls it for you."""
        if self.engine is not None:
            self.engine.note_forward_end()
            self.link.forward_ended(self.engine.sync_enabled)

    def abort(self, reason: str = "abort() after a backward raised") -> None:
        """GradSync.abort (its docstring is the contract)."""
        if self.engine is not None:
            self.engine.abort()
        self.link.abandon(reason)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """GradSync.zero_grad (its docstring is the contract)."""
        if self.engine is None:
            for p in self.params[0]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            return
        self.check_open()
        # GPUs: the current streams after the reductions (what touches the
        # buckets next runs there); a dead context says so here.
        for r in range(len(self.replicas)):
            self.order.use_current(self.engine, r)
        if set_to_none:
            # No write to the buckets: the next gradients are copied in as
            # they arrive (BucketLayout.hand_over).
            self.layout.hand_over()
        else:
            self.run_per_replica(
                [partial(self.layout.zero, r) for r in range(len(self.replicas))], "zero_grad"
            )
        self.engine.clear_grads(set_to_none)
        self.layout.forget_reduced()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """GradSync.no_sync (its docstring is the contract)."""
        if self.engine is None:
            yield
            return
        previous = self.engine.sync_enabled
        self.engine.set_sync(False)
        try:
            yield
        finally:
            self.engine.set_sync(previous)

    def check_step(self) -> None:
        """GradSync.check_step (its docstring is the contract)."""
        if self.engine is None:
            return
        self.check_open()
        if self.engine.active:
            raise RuntimeError(
                "pyddp: cannot step: a backward ran but finish() was not called, so its "
                "gradients are not fully reduced; call finish() once every replica's backward "
                "has returned (abort() and zero_grad() if one raised)"
            )
        try:
            self.engine.check()
        except ReduceError as e:
            raise ReduceError(f"{e}; call zero_grad() and run the step again") from None
        if self.engine.partial:
            raise RuntimeError(f"pyddp: cannot step: {self.engine.partial_reason}")
        self.layout.align()

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("pyddp: this GradSync (or wrapped model) was closed")

    def reattach(self) -> None:
        if self.engine is None:
            return
        self.check_open()
        self.plan.reattach()

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        if self.engine is None:  # one replica in one process: the link says it is unused
            self.link.register_comm_hook(state, resolve_hook(hook))
            return
        self.check_open()
        used = self.observer.last is not None or self.engine.active
        self.plan.register_comm_hook(state, hook, self.gpu_devices is not None, used)

    # ------------------------------------------------------------ statistics
    def observe(self) -> None:
        self.observer.observe(self.engine, self.link, self.layout, self.finish_called_ns)

    def stats(self) -> Dict[str, Any]:
        return self.observer.stats(self.adopted, len(self.buckets), self.engine is not None)

    def export_timeline(self, path: Any) -> Any:
        if self.engine is None:
            raise RuntimeError("one replica: there is no communication to trace")
        return self.observer.export(path, self.names, self.engine.buckets, len(self.replicas))

    def ready_times(self) -> Any:
        return self.observer.ready_times(self.names, self.params[0])

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.engine is not None and self.link.spans_processes and self._link_usable():
                self.link.settle()
        finally:
            self.finalizer()

    def _link_usable(self) -> bool:
        try:
            self.link.check_usable()
        except ProcessGroupError:
            return False  # it failed already, and said so where it happened
        return True

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


def _in_turn(fns: Sequence[Callable[[], Any]], what: str) -> List[Any]:
    return [fn() for fn in fns]
