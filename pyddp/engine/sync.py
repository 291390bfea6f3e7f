"""GradSync: gradient synchronisation for replica modules the caller already
placed, the low-level API that `wrap` is built on and that other training loops
embed. It composes the rooms of the engine's Python side:

    hook (_hooks) -> engine (C++) -> backend (C++) -> link (_link) -> finish (here)

with the bucket layout (_buckets: flat buffers, views), the replica checks
(_replica_checks) and the statistics (observe). It holds no "is there another
process" branches: a single process has a link that does nothing."""

from __future__ import annotations

import contextlib
import sys
import time
import warnings
import weakref
from collections import Counter
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import _C
from .._link import WorkRecord, connect, resolve_group
from .._link.route import DeviceRoute
from ..errors import ProcessGroupError, ReduceError
from ..runtime.libraries import make_backend, nvrtc_path
from .buckets import BucketLayout, ddp_plan, plan_buckets
from .comm_hooks import WIRE_DTYPES, check_gpu_state, gpu_wire_dtype, resolve_hook
from .hooks import PrepareHook, grad_hook
from .observe import Observer, ReadyTimes, chrome_trace, ready_times, write_trace
from .options import Options
from .params import dtype_name, trainable_params
from .placement import gpu_placement
from .replica_checks import check_identical, note_synced, refuse_synced_twice
from .streams import StreamOrder

_MIB = 1 << 20


class GradSync:
    """Reduces the gradients of N identical replicas during backward.

    Usage by another training loop (each replica on its own thread or not)::

        sync = pyddp.GradSync([m0, m1])        # modules already on their devices
        for each replica r: loss_r = f(m_r(x_r)); loss_r.backward()
        sync.finish()                          # after every replica's backward
        step each replica's optimizer; sync.zero_grad()

    Gradients are summed (``op="sum"``) or averaged (``op="avg"``) across replicas.
    Call ``finish()`` once every replica's backward has returned, ``abort()`` if one
    raised, and run every backward of an accumulation but the last under
    ``no_sync()``. Prefer ``sync.zero_grad()`` to ``opt.zero_grad()``: it keeps the
    bucket views attached (a torch ``zero_grad`` makes the next backward copy).

    Options: ``bucket_cap_mb`` (25; 0 = per-parameter mode, every parameter its own
    bucket), ``first_bucket_cap_mb`` (1), ``taper_buckets`` (False; True: the last
    buckets shrink by halves down to the first bucket's size), ``reduce_order``
    ("ready": launch buckets as they complete; "index": in bucket order),
    ``rebuild_buckets`` (True: re-plan buckets once from the ready order observed
    in the first synced backward),
    ``timeout_s`` (GPU: a reduction not done after this long aborts communication
    and raises; default $PYDDP_TIMEOUT_S or 300), ``timeline`` (keep the last N
    iterations' bucket and parameter events for `export_timeline`; default
    $PYDDP_TIMELINE or 0 = off), ``check_replicas`` (True: refuse replicas whose
    parameters differ from replica 0's at construction; False if you make them
    equal yourself), ``group`` (a torch.distributed process group to span;
    default: every process once torch.distributed is initialised, see below).

    Across processes: every rank builds the same GradSync (same parameters,
    checked); rank 0's parameters and buffers are broadcast at construction;
    gradients are reduced over this process's replicas (``op``) and averaged
    over processes (torch DDP's convention), buckets launching in index order
    on rank 0's bucket plan; a reduction not done after ``timeout_s`` raises
    ReduceError naming the bucket and the ranks that did not arrive.

    Lifecycle: ``close()`` (or ``with GradSync(...) as sync:``, or dropping the
    last reference) removes the hooks and releases threads and communicators.
    The modules stay usable, copyable and picklable: they carry no live pyddp
    state. A parameter can be synchronised by one open GradSync at a time.

    Backends: CPU replicas reduce in process; one replica per GPU uses NCCL;
    replicas sharing one GPU use pyddp's own kernel. On GPUs nothing blocks the
    host: each gradient's reduction waits (on the GPU) for an event recorded on
    the stream that produced it; every stream that wrote a bucket (forward
    streams, producing streams, the caller's stream at finish) waits for the
    reductions before it can touch the bucket again. Read gradients on the
    stream backward ran on, or synchronize.
    """

    def __init__(
        self,
        replicas: Sequence[nn.Module],
        *,
        _prepare_on_forward: bool = True,
        _options: Optional[Options] = None,
        **options: Any,
    ):
        replicas = list(replicas)
        if not replicas:
            raise ValueError("replicas is empty: pass at least one module")
        for m in replicas:
            if not isinstance(m, nn.Module):
                raise TypeError(f"replicas must be torch.nn.Module objects, got {type(m).__name__}")
        opts = _options if _options is not None else Options.for_sync(options)
        group = resolve_group(opts.group)
        if opts.reduce_order is None:
            opts = opts.replace(reduce_order="ready" if group is None else "index")
        elif group is not None and opts.reduce_order == "ready":
            raise ValueError(
                "reduce_order='ready' across processes: every rank must launch the same "
                "sequence, so buckets launch in index order ('index', the default there)"
            )
        self.options = opts
        self.replicas = replicas
        self.names, self.params = trainable_params(replicas)
        refuse_synced_twice(self.names, self.params)
        if opts.check_replicas:
            check_identical(replicas)
        self.devices = [params[0].device for params in self.params]
        # GPU replicas: their CUDA device indices and the stream provider.
        gpu = gpu_placement(self.devices, "GradSync")
        self._gpu_devices: Optional[List[int]] = None if gpu is None else gpu[0]
        self._streams: Optional[Any] = None if gpu is None else gpu[1]
        self._order = StreamOrder(self._gpu_devices, self._streams)
        self._cap = int(opts.bucket_cap_mb * _MIB)
        self._first_cap = int(opts.first_bucket_cap_mb * _MIB) if self._cap else 0
        self._taper = opts.taper_buckets
        self._engine: Optional[Any] = None
        self._handles: List[Any] = []
        # Run when close() is called or this object is dropped: removes the
        # hooks (which hold the engine, not this object) and closes the engine.
        self._finalizer = weakref.finalize(self, _release, self._handles, None)
        # Runs one function per replica; wrap installs its parallel workers.
        self.run_per_replica: Callable[[Sequence[Callable[[], Any]], str], List[Any]] = _in_turn
        self._closed = False
        self._shadowing = False  # shadow_backward() under way
        self._hook_set = False  # register_comm_hook was called (once, as with DDP)
        # wrap's, with one replica per process: a weak method the gradient
        # hooks call, so a backward that bypasses the wrapped model's outputs
        # still ends with finish() (_hooks._began).
        self.on_backward_start: Optional[weakref.WeakMethod] = None
        # torch DDP's static_graph and find_unused_parameters: they shape its
        # bucket plan, which a hook sees (_plan_as_ddp, which sets _ddp_plan).
        self._ddp_args = (opts.static_graph, opts.find_unused_parameters)
        self._ddp_plan = False
        keep = opts.keep()
        self.observer = Observer(keep)
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
            self._gpu_devices,
        )
        # Compared across processes at every synced backward (the agreement).
        self._work = WorkRecord(self.params[0], replicas[0], self._gpu_devices is not None)
        self.link.watch(self._work)
        if len(replicas) == 1 and not self.link.spans_processes:
            return  # one replica: nothing to reduce, stay out of the way

        first = self.params[0]
        numels = [p.numel() for p in first]
        dtypes = [dtype_name(n, p) for n, p in zip(self.names, first)]
        buckets = plan_buckets(
            numels,
            dtypes,
            list(reversed(range(len(first)))),
            self._first_cap,
            self._cap,
            self._taper,
        )
        op, self._post_scale, rendezvous = opts.op, 1.0, None
        if self._gpu_devices is not None:
            op, self._post_scale, rendezvous = self.link.gpu_reduction(op, len(replicas))
        self._op = op
        # Held here too: _runtime closes every live backend at interpreter exit.
        local = make_backend(self._gpu_devices or self.devices, opts.timeout_s, rendezvous)
        self._backend = self.link.transport_backend(local, self._gpu_devices is not None)
        if self._gpu_devices is not None:
            self.link.route_through(self._backend, self._gpu_devices, self._streams)
        self._engine = _C.Engine(
            len(replicas), self.names, numels, dtypes, buckets, opts.reduce_order, op, self._backend
        )
        self.layout = BucketLayout(
            self.params,
            dtypes,
            self._engine.set_buffer,
            self._gpu_devices,
            self._order.fence,
            self._order.zeros,
        )
        self._allocate(buckets)
        for i in range(len(first)):
            if any(ps[i].grad is not None for ps in self.params):
                self._engine.note_grad(i, True)
        self._rebuild_pending = opts.rebuild_buckets and self._cap > 0
        self._rebuild_allowed = opts.rebuild_buckets
        self._engine.set_timeline(keep > 0)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, self._handles, self._engine)
        owner, mark = weakref.ref(self), self._engine.mark_ready
        # wrap with one replica per process may set on_backward_start; only
        # then do the hooks pay for the call (a Python call per gradient).
        began = len(replicas) == 1 and not _prepare_on_forward
        for r, (module, params) in enumerate(zip(replicas, self.params)):
            device = -1 if self._gpu_devices is None else self._gpu_devices[r]
            views = self.layout.views[r]
            for i, p in enumerate(params):
                hook = grad_hook(owner, views, r, i, mark, self._streams, device, began)
                self._handles.append(p.register_post_accumulate_grad_hook(hook))
            if _prepare_on_forward:  # wrap prepares all replicas itself, hook-free
                self._handles.append(module.register_forward_pre_hook(PrepareHook(self, r)))
        note_synced(self)
        if _prepare_on_forward and any(
            isinstance(m, nn.SyncBatchNorm) for r in replicas for m in r.modules()
        ):
            # Used directly, GradSync reduces gradients only: the layers would
            # normalize per replica (one process) or raise (torch's, on CPUs).
            warnings.warn(
                "pyddp.GradSync does not synchronize SyncBatchNorm statistics across its "
                "replicas (only gradients): use pyddp.wrap, which does",
                stacklevel=2,
            )

    # ----------------------------------------------------------------- layout
    def _allocate(self, buckets: Sequence[Sequence[int]]) -> None:
        old = self.layout.memory()
        self.layout.allocate(buckets)
        self._order.retire(self._engine, old)
        self.link.set_buckets(self.layout.flat[0], buckets, self.params[0], self.layout.views[0])

    @property
    def gpu_devices(self) -> Optional[List[int]]:
        """GPU replicas' CUDA device indices (None on CPU)."""
        return self._gpu_devices

    def device_route(self) -> DeviceRoute:
        """GPU replicas: sums outside the buckets on the engine's NCCL
        communicator (every GPU of every process), on the current streams."""
        if self._gpu_devices is None or self._engine is None:
            raise RuntimeError("pyddp: device_route() needs GPU replicas that reduce")
        return DeviceRoute(self._backend, self._gpu_devices, self._streams)

    @property
    def streams(self) -> Optional[Any]:
        """The CUDA stream provider of GPU replicas (None on CPU): replica
        workers run their work on the caller's current streams through it."""
        return self._streams

    @property
    def reduces(self) -> bool:
        """Whether there is anything to reduce: False for one replica in one
        process, where GradSync stays out of the way."""
        return self._engine is not None

    @property
    def syncing(self) -> bool:
        """Whether the next backward reduces (False under no_sync())."""
        return self._engine is None or self._engine.sync_enabled

    @property
    def adopted(self) -> int:
        """Gradients that arrived outside the buckets and were copied in."""
        return self.layout.adopted if self._engine is not None else 0

    def grads_moved(self) -> bool:
        """Whether replica 0's gradients left their bucket views (Module._apply
        replaced their storage, or a gradient was assigned): reattach() then."""
        return self._engine is not None and self.layout.moved()

    def _rebuild(self) -> None:
        # Every process plans from rank 0's order.
        order = self.link.root_order(self._engine.ready_order(), len(self.names)) or []
        if len(order) != len(self.names):
            return
        if self._ddp_plan:  # torch DDP's rebuilt plan: a hook sees it
            buckets = ddp_plan(self.params[0], [self._first_cap, self._cap], order)
        else:
            numels = [p.numel() for p in self.params[0]]
            buckets = plan_buckets(
                numels, self.layout.dtypes, order, self._first_cap, self._cap, self._taper
            )
        self._set_plan(buckets)

    def _set_plan(self, buckets: List[List[int]]) -> None:
        if buckets == self._engine.buckets:
            return
        self._order.fence_all()
        self._engine.set_buckets(buckets)
        self._allocate(buckets)

    def _plan_as_ddp(self) -> None:
        """A communication hook sees buckets: from now on they are torch
        DDP's for the same arguments (its initial plan, then its rebuild
        from rank 0's ready order, or none with find_unused_parameters)."""
        static, unused = self._ddp_args
        if static or not unused:
            limits = [sys.maxsize]  # DDP's first iteration: one bucket
        elif self._first_cap < self._cap:
            limits = [self._first_cap, self._cap]
        else:
            limits = [self._cap]
        self._ddp_plan = True
        # DDP rebuilds once unless it looks for unused parameters every step.
        self._rebuild_pending = self._rebuild_allowed and (static or not unused)
        self._set_plan(ddp_plan(self.params[0], limits))

    # ------------------------------------------------------------- iteration
    def prepare(self, replica: int) -> None:
        """Called before replica `replica` accumulates again (its forward pre-hook
        does it): after a reduction every replica holds the same sum, so replicas
        other than 0 clear their copy, keeping sum-over-replicas exact."""
        if self._engine is None:
            return
        self._check_open()
        # Backward runs on the stream its forward runs on: this one. It and the
        # zeroing below come after the last reduction of these buckets.
        self._order.use_current(self._engine, replica)
        self._clear_reduced_copy(replica)

    def _clear_reduced_copy(self, replica: int, fence: bool = False) -> None:
        """Drops replica `replica`'s copy of the last reduction, if it holds
        one. Sum: replica 0's copy alone carries the previous sum into the
        next one. Average: every copy does (each holds the mean, and the next
        mean of (mean + new) is mean + new mean). `fence`: order the current
        stream after the reductions first (prepare has done it already)."""
        if not (self._engine.take_reduced_copy(replica) and replica > 0 and self._op == "sum"):
            return
        if fence:
            self._order.use_current(self._engine, replica)
        self.layout.zero(replica)

    def restart_accumulation(self) -> None:
        """At the start of a backward: replicas whose copy of the last
        reduction is still there (a second backward over a graph kept with
        retain_graph=True, with no forward in between) clear it, as prepare
        does, so the sum over replicas stays exact."""
        if self._engine is None:
            return
        for r in range(len(self.replicas)):
            self._clear_reduced_copy(r, fence=True)

    def prepare_all(self) -> None:
        """Before a step that drives every replica from one thread: drops a
        backward that failed without abort(), then prepares every replica."""
        if self._engine is None:
            return
        self.link.check_usable()
        if self._engine.active:
            self._engine.abort()
            self.link.abandon_unfinished()
        for r in range(len(self.replicas)):
            self.prepare(r)

    def finish(self) -> None:
        """End of backward: reduces what is left (unused parameters), waits for every
        reduction, and leaves parameters nobody produced a gradient for at None.
        Raises ReduceError (naming bucket and parameters) if a reduction failed."""
        if self._engine is None:
            return
        # Autograd is done here: what follows (settling unused parameters, the
        # agreement across processes) counts as finish, not backward compute.
        self._finish_called_ns = time.monotonic_ns()
        self._work.backward_done()  # this backward, synced or under no_sync()
        # Unmarked slices are reconciled on the current streams; their
        # reductions wait for them, and they wait for the reductions.
        streams = self._order.current()
        self._order.fence_all()
        synced = self._engine.sync_enabled
        launched: List[int] = []
        unused: List[int] = []
        factor: Any = 1.0
        try:
            self._settle_unmarked()  # across processes, may hear that a peer failed
            no_grad, reduced_partly = self._engine.finish(streams)
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
            self._observe()
        for i in no_grad:
            self.layout.grads_to_none(i)
        for i in reduced_partly:
            self.layout.point_grads(i)
        # Reduced across processes through replica 0's buffers (already
        # divided by the number of processes): the other replicas get them.
        self.layout.copy_to_others(launched)
        for i in unused:  # no gradient on any process: None, as on one device
            self._engine.note_grad(i, False)
            self.layout.grads_to_none(i)
        if synced and self._post_scale != 1.0:
            # NCCL summed over every process's GPUs: average over processes.
            # On the caller's streams, which finish() ordered after the
            # reductions (no host wait on a GPU).
            self._order.fence_all()
            self.layout.scale(self._post_scale)
        if isinstance(factor, list) or factor != 1.0:
            # dmodel.loss weighed on the rows assumed across processes: the
            # global batch's own (a float, or per replica on its GPU).
            self._order.fence_all()
            self.layout.scale(factor)
        if self._rebuild_pending and synced:
            self._rebuild_pending = False
            self._rebuild()
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
        if self._engine is None or not self.link.spans_processes:
            return
        if not self._engine.sync_enabled:
            raise RuntimeError(
                "pyddp: a rank that joined (torch's Join) is under no_sync(): it must shadow "
                "the other ranks' synced backward; leave no_sync() before the Join block ends"
            )
        self.prepare_all()
        kept = self._keep_grads()
        self.zero_grad(set_to_none=True)  # every gradient absent here: zeros on the wire
        self._shadowing = True
        try:
            self.finish()
        finally:
            self._shadowing = False
            self._restore_grads(kept)

    def _keep_grads(self) -> Tuple[Any, List[bool], List[bool]]:
        """This rank's gradients as they are: the layout's (values, which
        are None), and the engine's (which it counts as present, which
        replicas hold a reduced copy)."""
        engine = self._engine
        self._order.fence_all()  # the copies read after any reduction still writing
        present = [engine.has_grad(i) for i in range(len(self.names))]
        copies = [engine.holds_reduced_copy(r) for r in range(len(self.replicas))]
        return self.layout.keep(), present, copies

    def _restore_grads(self, kept: Tuple[Any, List[bool], List[bool]]) -> None:
        grads, present, copies = kept
        self._order.fence_all()  # after the shadowed reductions
        self.layout.put_back(grads)
        for i, had in enumerate(present):
            self._engine.note_grad(i, had)
        for r, held in enumerate(copies):
            self._engine.restore_reduced_copy(r, held)

    @property
    def work(self) -> WorkRecord:
        """The record of this GradSync's work that the ranks compare at each
        synced backward (optimizer steps, micro-batches; _link/record.py)."""
        return self._work

    def _wait_for_link(self) -> Tuple[List[int], List[int], Any]:
        try:
            return self.link.wait()
        except ProcessGroupError as e:
            self._engine.abort()
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
        unmarked = self._engine.unmarked()
        nowhere = {i for i, n in Counter(i for _, i in unmarked).items() if n == len(self.replicas)}
        none_here = {i for i in nowhere if self.params[0][i].grad is None}
        if self._engine.sync_enabled:
            absent = sorted(none_here | {i for i in nowhere if not self._engine.has_grad(i)})
            agreeing = self.link.start_agreement(
                absent, len(self.names), self._work.take, self._shadowing
            )
            for i in agreeing:
                self._engine.note_grad(i, True)
                self.layout.zero_param(i)
                none_here.discard(i)
        for i in sorted(none_here):
            self._engine.note_grad(i, False)
            self.layout.zero_param(i)  # None slices read zero (clipping sums buckets)
        for r, i in unmarked:
            self.layout.take_in(r, i)

    def reattach(self) -> None:
        """Points every gradient into fresh bucket buffers again, keeping the
        values: after `Module._apply` (share_memory(), .to(memory_format=...),
        .half().float()) replaced parameter and gradient storage."""
        if self._engine is None:
            return
        self._check_open()
        if self._engine.active:
            self._engine.abort()
        self._order.fence_all()
        self._allocate(self._engine.buckets)

    def _observe(self) -> None:
        raw = self._engine.last_stats()
        if not raw["iteration"] or (self.observer.last or {}).get("iteration") == raw["iteration"]:
            return
        # The flat buffers are the buckets: O(buckets) per step, no walk over parameters.
        timeline = self._engine.last_timeline() if self.observer.keep else None
        self.link.merge_timing(raw, timeline, self._finish_called_ns)
        self.observer.record(raw, self.layout.bucket_bytes(), timeline)

    def note_forward_end(self) -> None:
        """Marks the end of the forward whose backward comes next (the start of
        DDP's "backward compute"); wrap calls it for you."""
        if self._engine is not None:
            self._engine.note_forward_end()

    def export_timeline(self, path: Any) -> Any:
        """Writes the kept iterations as Chrome trace JSON (open in Perfetto or
        chrome://tracing) and returns the path."""
        if self._engine is None:
            raise RuntimeError("one replica: there is no communication to trace")
        if not self.observer.keep:
            raise RuntimeError(
                "the timeline is off: pass timeline=N (iterations to keep) or set PYDDP_TIMELINE"
            )
        trace = chrome_trace(
            list(self.observer.timelines), self.names, self._engine.buckets, len(self.replicas)
        )
        return write_trace(trace, path)

    def ready_times(self) -> ReadyTimes:
        """When each of replica 0's gradients became ready in the last kept
        iteration (needs timeline=N), relative to the end of forward, with
        backward's length: the profile `pyddp.bench.simulator` scales up. On
        GPUs these are when autograd's hooks ran on the host."""
        return ready_times(self.observer.timelines, self.names, self.params[0])

    def abort(self, reason: str = "abort() after a backward raised") -> None:
        """A replica's backward raised: drop the iteration (waits for in-flight
        reductions). Gradients are incomplete until the next zero_grad().
        Across processes the other ranks are told (they fail at once instead
        of at the timeout) and this GradSync refuses further steps."""
        if self._engine is not None:
            self._engine.abort()
        self.link.abandon(reason)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes every replica's gradients. With set_to_none, parameters that get
        no gradient in the next backward read None afterwards, as on one device
        (until then they read zeros: the bucket views stay attached)."""
        if self._engine is None:
            for p in self.params[0]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            return
        self._check_open()
        for r in range(len(self.replicas)):
            self._order.use_current(self._engine, r)
        self.run_per_replica(
            [partial(self.layout.zero, r) for r in range(len(self.replicas))], "zero_grad"
        )
        self._engine.clear_grads(set_to_none)
        self.layout.forget_reduced()

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """torch DDP's `register_comm_hook`. Across processes on CPU replicas:
        `hook(state, bucket)` reduces one bucket and returns a
        torch.futures.Future of the result, averaged over processes (it
        replaces pyddp's all-reduce of that bucket; this process's replicas
        are summed before). `bucket` has torch's GradBucket methods (index,
        buffer, gradients, parameters, is_last, set_buffer), so DDP's own hooks
        work: `"fp16"` and `"bf16"` name default_hooks.fp16_compress_hook and
        bf16_compress_hook (16 bits on the wire, divided by the world before
        the sum so it cannot overflow, cast back into the bucket). `state`
        None: the process group the buckets travel on. On GPUs (NCCL, in one
        process or across processes) pyddp's core runs those two itself,
        bitwise their arithmetic; other hooks are refused there. Before the
        first backward, once."""
        hook = resolve_hook(hook)
        if self._engine is None:  # one replica in one process: the link says it is unused
            self.link.register_comm_hook(state, hook)
            return
        self._check_open()
        if self._hook_set:
            raise RuntimeError(
                "pyddp: a communication hook is already registered; register one, once, as "
                "with torch DDP"
            )
        if self.observer.last is not None or self._engine.active:
            raise RuntimeError(
                "pyddp: register_comm_hook must be called before the first backward (as with "
                "torch DDP): every rank must reduce every step the same way"
            )
        if self._gpu_devices is None:
            self.link.register_comm_hook(state, hook)
            if self.link.spans_processes:
                self._plan_as_ddp()
        else:
            self._compress_on_gpus(state, hook)  # elementwise: the grouping does not matter
        self._hook_set = True

    def _compress_on_gpus(self, state: Any, hook: Callable[..., Any]) -> None:
        """The hook on GPUs: torch's 16-bit hooks run by the NCCL backend."""
        wire = gpu_wire_dtype(hook)
        check_gpu_state(state, self.link.group)
        if wire == "float32":
            return
        if not hasattr(self._backend, "set_compression"):
            warnings.warn(
                "pyddp: the communication hook is not used: these replicas share one GPU, and "
                "pyddp's kernel reduces them in its memory (nothing crosses a wire)",
                stacklevel=4,
            )
            return
        self._backend.set_compression(wire, nvrtc_path("compressed buckets convert with NVRTC"))
        self.layout.wire_dtype = WIRE_DTYPES[wire]
        self._allocate(self._engine.buckets)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate locally; the next synced backward reduces
        the accumulated sum. The backward must run inside the block."""
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
        """Raises if stepping now would let replicas diverge, including for a GPU
        reduction that failed or timed out after finish() returned."""
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
        self.layout.align()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("pyddp: this GradSync (or wrapped model) was closed")

    # ----------------------------------------------------------------- access
    def flat_grads(self, replica: int) -> List[torch.Tensor]:
        """Tensors holding all of one replica's gradients, for in-place ops: the
        flat bucket buffers (None ones read as zeros), or with one replica the
        gradients themselves."""
        if self._engine is None:  # the gradients themselves: in-place ops must reach them
            return [p.grad for p in self.params[replica] if p.grad is not None]
        return list(self.layout.flat[replica])

    @property
    def buckets(self) -> List[List[int]]:
        if self._engine is None:
            return [list(range(len(self.names)))]
        return [list(b) for b in self._engine.buckets]

    def stats(self) -> Dict[str, Any]:
        """The last synced iteration (DDP's definitions, see pyddp.engine.observe) at the
        top level, running means under "mean", and the iteration count."""
        if self._engine is None or self.observer.last is None:
            return {
                "iteration": 0,
                "bytes": 0,
                "launches": 0,
                "buckets": len(self.buckets),
                "adopted": self.adopted,
                "mean": {},
            }
        out = dict(self.observer.last)
        out["adopted"] = self.adopted
        out["mean"] = self.observer.means()
        return out

    def inject_fault(self, bucket: int, message: str = "injected fault") -> None:
        """Testing aid: the next reduction of `bucket` fails with `message`."""
        if self._engine is None:
            raise RuntimeError("one replica: there are no reductions to fail")
        self._engine.inject_fault(bucket, message)

    def close(self) -> None:
        """Removes the hooks and releases the backend's threads and GPU
        communicators; gradients stay where they are. Idempotent; dropping the
        last reference does the same. Across processes on GPUs, the last
        agreement's sums are checked first (raises if the ranks' work differed)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._engine is not None and self.link.spans_processes and self._link_usable():
                self.link.settle()
        finally:
            self._finalizer()

    def _link_usable(self) -> bool:
        try:
            self.link.check_usable()
        except ProcessGroupError:
            return False  # it failed already, and said so where it happened
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> GradSync:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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
