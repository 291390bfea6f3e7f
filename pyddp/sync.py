"""GradSync: gradient synchronisation for replica modules the caller already
placed, the low-level API that `wrap` is built on and that other training loops
embed. It owns the flat per-bucket gradient buffers (each `param.grad` is a view
into them), the autograd hooks that feed the C++ engine, and the end-of-backward
bookkeeping (unused parameters, bucket rebuild)."""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections import Counter
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _C
from ._params import dtype_name, trainable_params
from ._runtime import backend_kind, make_backend
from ._runtime import timeout_s as _default_timeout
from ._streams import TorchStreams
from ._xproc import CrossProcess, ProcessGroupError, nccl_op, resolve_group
from .observe import Observer, ReadyTimes, chrome_trace, ready_times, timeline_from_env, write_trace

ReduceError = _C.ReduceError

_MIB = 1 << 20
CHECKSUM_EVERY = 16  # synced backwards between parameter checksums across processes


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
    bucket), ``first_bucket_cap_mb`` (1), ``reduce_order`` ("ready": launch buckets
    as they complete; "index": in bucket order), ``rebuild_buckets`` (True: re-plan
    buckets once from the ready order observed in the first synced backward),
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
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        reduce_order: Optional[str] = None,
        rebuild_buckets: bool = True,
        op: str = "sum",
        timeout_s: Optional[float] = None,
        timeline: Optional[int] = None,
        check_replicas: bool = True,
        group: Any = None,
        _gpu: Optional[Tuple[Sequence[int], Any]] = None,
        _prepare_on_forward: bool = True,
        _settings: Optional[Dict[str, Any]] = None,
    ):
        replicas = list(replicas)
        if not replicas:
            raise ValueError("replicas is empty: pass at least one module")
        for m in replicas:
            if not isinstance(m, nn.Module):
                raise TypeError(f"replicas must be torch.nn.Module objects, got {type(m).__name__}")
        if bucket_cap_mb < 0 or first_bucket_cap_mb < 0:
            raise ValueError(
                f"bucket_cap_mb={bucket_cap_mb} and first_bucket_cap_mb={first_bucket_cap_mb} "
                "must be >= 0 (0 = one bucket per parameter)"
            )
        xgroup = resolve_group(group)
        if reduce_order is None:
            reduce_order = "ready" if xgroup is None else "index"
        if reduce_order not in ("ready", "index", "after_backward"):
            raise ValueError(
                f"reduce_order={reduce_order!r}: use 'ready', 'index' or 'after_backward' "
                "(no overlap: the baseline benchmarks compare against)"
            )
        if op not in ("sum", "avg"):
            raise ValueError(f"op={op!r}: use 'sum' or 'avg'")
        if xgroup is not None and reduce_order == "ready":
            raise ValueError(
                "reduce_order='ready' across processes: every rank must launch the same "
                "sequence, so buckets launch in index order ('index', the default there)"
            )
        self.replicas = replicas
        self.names, self.params = trainable_params(replicas)
        _refuse_synced_twice(self.names, self.params)
        if check_replicas:
            _check_identical(replicas)
        self.devices = [params[0].device for params in self.params]
        # GPU replicas: their CUDA device indices and the stream provider. The
        # test suite passes _gpu to run this path on a simulated driver with
        # host tensors; with torch's CUDA it comes from the parameters.
        if _gpu is None and self.devices[0].type == "cuda":
            _gpu = ([d.index for d in self.devices], TorchStreams([d.index for d in self.devices]))
        self._gpu_devices: Optional[List[int]] = None if _gpu is None else list(_gpu[0])
        self._streams: Optional[Any] = None if _gpu is None else _gpu[1]
        if self._gpu_devices is not None and len(self._gpu_devices) != len(replicas):
            raise ValueError("_gpu devices must name one CUDA device per replica")
        self._cap = int(bucket_cap_mb * _MIB)
        self._first_cap = int(first_bucket_cap_mb * _MIB) if self._cap else 0
        self._engine: Optional[Any] = None
        self._handles: List[Any] = []
        # Run when close() is called or this object is dropped: removes the
        # hooks (which hold the engine, not this object) and closes the engine.
        self._finalizer = weakref.finalize(self, _release, self._handles, None)
        # Runs one function per replica; wrap installs its parallel workers.
        self.run_per_replica: Callable[[Sequence[Callable[[], Any]], str], List[Any]] = _in_turn
        self.adopted = 0  # gradients that arrived outside the buckets and were copied in
        self._grad_versions: Optional[List[List[int]]] = None  # the buckets' at finish()
        self._closed = False
        keep = timeline_from_env() if timeline is None else timeline
        if keep < 0:
            raise ValueError(f"timeline={timeline} must be >= 0 (iterations to keep)")
        self.observer = Observer(keep)
        self._xproc: Optional[CrossProcess] = None
        # Compared across processes at every synced backward (_agreement_record).
        self.backwards_since_sync = 0  # synced or under no_sync()
        self.steps = 0  # optimizer steps over replica 0's parameters (_count_step)
        self._stepping: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        if xgroup is not None:
            settings = {
                "bucket_cap_mb": bucket_cap_mb,
                "first_bucket_cap_mb": first_bucket_cap_mb,
                "reduce_order": reduce_order,
                "rebuild_buckets": rebuild_buckets,
                "op": op,
                **(_settings or {}),
            }
            self._join_processes(xgroup, timeout_s, op, settings)
            _across_processes.add(self)  # its optimizer steps are counted
        if len(replicas) == 1 and self._xproc is None:
            return  # one replica: nothing to reduce, stay out of the way

        first = self.params[0]
        numels = [p.numel() for p in first]
        self._dtypes = [dtype_name(n, p) for n, p in zip(self.names, first)]
        buckets = _C.plan_buckets(
            numels, self._dtypes, list(reversed(range(len(first)))), self._first_cap, self._cap
        )
        # Held here too: _runtime closes every live backend at interpreter exit.
        self._post_scale = 1.0
        rendezvous = None
        if self._xproc is not None and self._gpu_devices is not None:
            rendezvous = self._xproc.nccl_rendezvous(len(replicas))
            op, self._post_scale = nccl_op(op, self._xproc.local_counts)
        self._op = op
        self._backend = make_backend(self._gpu_devices or self.devices, timeout_s, rendezvous)
        if self._xproc is not None and self._gpu_devices is None:
            # This process's replicas sum in C++, then the launcher hands each
            # bucket to torch.distributed (launch holds no reference to self).
            local = self._backend
            self._backend = _C.GroupBackend(local, self._xproc.launch, f"{local.name}+gloo")
        self._engine = _C.Engine(
            len(replicas),
            self.names,
            numels,
            self._dtypes,
            buckets,
            reduce_order,
            op,
            self._backend,
        )
        self._views: List[List[Optional[torch.Tensor]]] = [[None] * len(first) for _ in replicas]
        self._flat: List[List[torch.Tensor]] = [[] for _ in replicas]
        self._layout(buckets)
        for i in range(len(first)):
            if any(ps[i].grad is not None for ps in self.params):
                self._engine.note_grad(i, True)
        self._rebuild_pending = rebuild_buckets and self._cap > 0
        self._engine.set_timeline(keep > 0)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, self._handles, self._engine)
        for r, (module, params) in enumerate(zip(replicas, self.params)):
            for i, p in enumerate(params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(r, i)))
            if _prepare_on_forward:  # wrap prepares all replicas itself, hook-free
                self._handles.append(module.register_forward_pre_hook(_PrepareHook(self, r)))
        _note_synced(self)

    # ----------------------------------------------------------------- layout
    def _layout(self, buckets: Sequence[Sequence[int]]) -> None:
        """Allocates flat buffers for `buckets` and points every gradient there,
        keeping the values gradients already hold."""
        for r, params in enumerate(self.params):
            flats = []
            for b, members in enumerate(buckets):
                count = sum(params[i].numel() for i in members)
                flat = torch.zeros(count, dtype=params[members[0]].dtype, device=params[0].device)
                offset = 0
                for i in members:
                    p = params[i]
                    view = flat[offset : offset + p.numel()].view_as(p)
                    offset += p.numel()
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view
                    self._views[r][i] = view
                device = -1 if self._gpu_devices is None else self._gpu_devices[r]
                self._engine.set_buffer(
                    r, b, flat.data_ptr(), count, self._dtypes[members[0]], device
                )
                flats.append(flat)
            self._flat[r] = flats
        if self._xproc is not None:
            self._xproc.flats = self._flat[0]
            self._xproc.buckets = [list(b) for b in buckets]
        self._view_ptrs = [v.data_ptr() for v in self._views[0]]

    def grads_moved(self) -> bool:
        """Whether replica 0's gradients left their bucket views (Module._apply
        replaced their storage, or a gradient was assigned): reattach() then.
        Reliable where parameter pointers are not: the buckets stay allocated,
        so a replaced gradient cannot reuse their addresses."""
        if self._engine is None:
            return False
        for p, ptr in zip(self.params[0], self._view_ptrs):
            g = p.grad
            if g is not None and g.data_ptr() != ptr:
                return True
        return False

    def _rebuild(self) -> None:
        order = self._engine.ready_order()
        if self._xproc is not None:  # every rank plans from rank 0's order
            order = self._xproc.root_order(order, len(self.names)) or []
        if len(order) != len(self.names):
            return
        numels = [p.numel() for p in self.params[0]]
        buckets = _C.plan_buckets(numels, self._dtypes, order, self._first_cap, self._cap)
        if buckets == self._engine.buckets:
            return
        self._settle_host_writes()
        self._engine.set_buckets(buckets)
        self._layout(buckets)

    # ------------------------------------------------------------------ hooks
    def _hook(self, r: int, i: int):
        # The hooks live on the replicas' parameters, replica 0's being the
        # user's model: they hold this object weakly, so dropping the wrapped
        # model releases it (its finalizer then removes them).
        views, owner = self._views[r], weakref.ref(self)
        mark = self._engine.mark_ready
        if self._streams is None:

            def on_grad(p: torch.Tensor) -> None:
                if p.grad is not views[i]:
                    _adopt(owner, p, views[i])
                mark(r, i)

            return on_grad
        streams, device = self._streams, self._gpu_devices[r]
        current = streams.current

        def on_grad_gpu(p: torch.Tensor) -> None:
            if p.grad is not views[i]:
                streams.before_host_write(device)
                _adopt(owner, p, views[i])
            # Autograd runs this hook on the stream that accumulated the
            # gradient: the reduction waits for that stream, not another.
            mark(r, i, current(device))

        return on_grad_gpu

    def _use_current_stream(self, r: int) -> None:
        """The current stream is about to write replica r's buckets: order it
        after the reductions still reading them (on the GPU)."""
        if self._streams is not None:
            device = self._gpu_devices[r]
            self._engine.use_stream(r, self._streams.current(device))
            self._streams.before_host_write(device)

    def _adopt(self, p: torch.Tensor, view: torch.Tensor) -> None:
        # The gradient is not the bucket view (grad was None, or replaced by the
        # user): copy it in once; later backwards accumulate in place.
        g = p.grad
        if g.is_sparse:
            raise RuntimeError(
                "pyddp: a parameter produced a sparse gradient; sparse gradients are not "
                "supported (construct nn.Embedding/EmbeddingBag with sparse=False)"
            )
        view.copy_(g)
        p.grad = view
        self.adopted += 1

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
        self._use_current_stream(replica)
        self._clear_stale(replica)

    def _clear_stale(self, replica: int, fence: bool = False) -> None:
        """Drops replica `replica`'s copy of the last reduction, if it holds
        one. Sum: replica 0's copy alone carries the previous sum into the
        next one. Average: every copy does (each holds the mean, and the next
        mean of (mean + new) is mean + new mean). `fence`: order the current
        stream after the reductions first (prepare has done it already)."""
        if not (self._engine.take_stale(replica) and replica > 0 and self._op == "sum"):
            return
        if fence:
            self._use_current_stream(replica)
        for flat in self._flat[replica]:
            flat.zero_()

    def restart_accumulation(self) -> None:
        """At the start of a backward: replicas whose copy of the last
        reduction is still there (a second backward over a graph kept with
        retain_graph=True, with no forward in between) clear it, as prepare
        does, so the sum over replicas stays exact."""
        if self._engine is None:
            return
        for r in range(len(self.replicas)):
            self._clear_stale(r, fence=True)

    def _count_step(self, optimizer: Any) -> None:
        """A step of `optimizer`: counted if it steps replica 0's parameters."""
        steps_ours = self._stepping.get(optimizer)
        if steps_ours is None:
            mine = {id(p) for p in self.params[0]}
            steps_ours = any(id(p) in mine for g in optimizer.param_groups for p in g["params"])
            self._stepping[optimizer] = steps_ours
        if steps_ours:
            self.steps += 1

    def prepare_all(self) -> None:
        """Before a step that drives every replica from one thread: drops a
        backward that failed without abort(), then prepares every replica."""
        if self._engine is None:
            return
        if self._xproc is not None and self._xproc.failed is not None:
            raise ProcessGroupError(self._xproc.failed)
        if self._engine.active:
            if self._xproc is not None:
                # The other ranks reduced (or wait to reduce) this backward's
                # buckets: carrying on would pair their step with our next one.
                self.abort("a backward did not finish (it raised?)")
                raise ProcessGroupError(self._xproc.failed)
            self._engine.abort()
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
        self.backwards_since_sync += 1  # this backward, synced or under no_sync()
        streams: List[int] = []
        if self._streams is not None:
            # Unmarked slices are reconciled on these streams; their reductions
            # wait for them, and they wait for the reductions.
            streams = [self._streams.current(d) for d in self._gpu_devices]
        self._settle_host_writes()
        self._reconcile_unmarked()
        across = self._xproc is not None and self._engine.sync_enabled
        try:
            no_grad, settled = self._engine.finish(streams)
            if across:
                launched, unused = self._wait_across_processes()
        except Exception as e:
            if across and not isinstance(e, ProcessGroupError):
                # A local failure after this rank's reductions were launched:
                # the others hear it now instead of at the timeout.
                self._xproc.abandon(f"its end of backward raised {type(e).__name__}: {e}")
            raise
        finally:
            self._observe()
        for i in no_grad:
            for params in self.params:
                params[i].grad = None
        for i in settled:
            # Reduced without every replica producing it: a replica whose grad
            # was None must now see the reduced bucket slice.
            for params, views in zip(self.params, self._views):
                if params[i].grad is not views[i]:
                    params[i].grad = views[i]
        if across:
            self._finish_across_processes(launched, unused)
            if self._post_scale != 1.0:
                # NCCL summed over every process's GPUs: average over processes.
                # On the caller's streams, which finish() ordered after the
                # reductions (no host wait on a GPU).
                self._settle_host_writes()
                with torch.no_grad():
                    for flats in self._flat:
                        torch._foreach_mul_(flats, self._post_scale)
        if self._rebuild_pending and self._engine.sync_enabled:
            self._rebuild_pending = False
            self._rebuild()
        self._grad_versions = [[f._version for f in flats] for flats in self._flat]

    def _agreement_record(self) -> Dict[str, int]:
        """What every rank must agree on at each synced backward (compared in
        the unused-parameter exchange that runs anyway): ranks that stepped,
        accumulated or switched mode differently would reduce different
        iterations' gradients together and diverge for good. Optimizer steps
        are counted by a hook on every optimizer stepping replica 0's
        parameters (dmodel.optimizer's or the user's own). The parameter
        checksum (the sum of replica 0's parameters' raw bits, as integers:
        exact whatever the thread count) is taken every CHECKSUM_EVERY synced
        backwards, on CPU replicas only (on GPUs it would make the host wait);
        it sees any change, writes through .data included."""
        checksum = 0
        if self._gpu_devices is None and self._xproc.iteration % CHECKSUM_EVERY == 0:
            with torch.no_grad():
                checksum = sum(_bits_sum(p) for p in self.params[0]) & 0x7FFFFFFFFFFFFFFF
        return {
            "synced backward": self._xproc.iteration + 1,
            "optimizer steps": self.steps,
            "micro-batches since the last synced backward": self.backwards_since_sync,
            # One BatchNorm left in eval() counts, not only the whole model.
            "modules in training mode": sum(m.training for m in self.replicas[0].modules()),
            "parameter checksum": checksum,
        }

    def _join_processes(
        self, group: Any, timeout: Optional[float], op: str, settings: Dict[str, Any]
    ) -> None:
        """At construction: the same model on every rank (else a ValueError
        naming the first difference), then rank 0's parameters and buffers
        everywhere, as torch DDP does."""
        if self._gpu_devices is not None and backend_kind(self._gpu_devices) != "nccl":
            raise NotImplementedError(
                "pyddp: across processes, GPU replicas need one GPU each (NCCL); several "
                "replicas sharing a GPU are supported in one process only"
            )
        # The group says which ranks: pyddp reduces on gloo groups of its own
        # over them (and NCCL for GPUs), whatever the group's backend.
        seconds = _default_timeout() if timeout is None else float(timeout)
        xp = CrossProcess(group, seconds, self.names)
        xp.join_model(self.replicas, self.devices[0].type, op, settings)
        self._xproc = xp

    def _wait_across_processes(self) -> Tuple[List[int], List[int]]:
        """After the engine: waits for the cross-process reductions and the
        agreement on unused parameters; returns (buckets reduced, parameters
        with a gradient on no process)."""
        try:
            return self._xproc.wait(), self._xproc.unused_everywhere()
        except ProcessGroupError as e:
            self._engine.abort()
            raise ReduceError(str(e)) from None

    def _finish_across_processes(self, launched: List[int], unused: List[int]) -> None:
        """Gives the reduced buckets (already divided by the number of
        processes) to this process's other replicas; unused ones return to None."""
        if len(self._flat) > 1:
            with torch.no_grad():
                for b in launched:
                    for flats in self._flat[1:]:
                        flats[b].copy_(self._flat[0][b])
        for i in unused:  # no gradient on any process: None, as on one device
            self._engine.note_grad(i, False)
            for params in self.params:
                params[i].grad = None

    def _align_grads(self) -> None:
        """Before a step: gradients changed on replica 0 only since finish()
        (torch's clip_grad_norm_ or a GradScaler's unscale_ over the model's own
        parameters) are copied to the other replicas, so every replica steps
        on the same values. Seen through the buckets' version counters."""
        if self._grad_versions is None:
            return
        now = [[f._version for f in flats] for flats in self._flat]
        if now == self._grad_versions:
            return
        moved0 = [a - b for a, b in zip(now[0], self._grad_versions[0])]
        for r in range(1, len(self._flat)):
            moved = [a - b for a, b in zip(now[r], self._grad_versions[r])]
            for b, (m, m0) in enumerate(zip(moved, moved0)):
                if m != m0:
                    if self._streams is not None:
                        self._streams.before_host_write(self._gpu_devices[r])
                    with torch.no_grad():
                        self._flat[r][b].copy_(self._flat[0][b])
        self._grad_versions = [[f._version for f in flats] for flats in self._flat]

    def _settle_host_writes(self) -> None:
        """Before the host writes or frees bucket memory: the reductions still
        using it must be done in stream order (torch's caching allocator gives
        that for free; the simulated driver's host memory does not)."""
        if self._streams is not None:
            for d in set(self._gpu_devices):
                self._streams.before_host_write(d)

    def reattach(self) -> None:
        """Points every gradient into fresh bucket buffers again, keeping the
        values: after `Module._apply` (share_memory(), .to(memory_format=...),
        .half().float()) replaced parameter and gradient storage."""
        if self._engine is None:
            return
        self._check_open()
        if self._engine.active:
            self._engine.abort()
        self._settle_host_writes()
        self._layout(self._engine.buckets)
        self._grad_versions = None

    def _observe(self) -> None:
        raw = self._engine.last_stats()
        if not raw["iteration"] or (self.observer.last or {}).get("iteration") == raw["iteration"]:
            return
        # The flat buffers are the buckets: O(buckets) per step, no walk over parameters.
        sizes = [f.numel() * f.element_size() for f in self._flat[0]]
        timeline = self._engine.last_timeline() if self.observer.keep else None
        if self._xproc is not None:
            # The engine saw its launches return; the reductions ended when
            # torch.distributed's futures completed, after finish() waited.
            done, xp = self._xproc.done_ns_last, self._xproc
            if done:
                raw["last_done_ns"] = max(raw["last_done_ns"], max(done.values()))
                if timeline is not None:
                    for b, t in done.items():
                        timeline["bucket_done_ns"][b] = t
            # The engine's clock is the steady clock: time.monotonic_ns here.
            raw["finish_start_ns"] = min(raw["finish_start_ns"], self._finish_called_ns)
            raw["wait_ns"] += xp.wait_ns
            raw["finish_end_ns"] += xp.wait_ns
            raw["agree_ns"] = xp.agree_ns
        self.observer.record(raw, sizes, timeline)

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

    def _reconcile_unmarked(self) -> None:
        # A replica that produced no gradient for a parameter contributes its
        # bucket slice as is. If its grad was reset behind pyddp's back (torch's
        # zero_grad sets None), the slice is stale and must count as zero. A
        # parameter produced by no replica whose canonical copy (replica 0) is
        # None stays None everywhere, as on one device.
        unmarked = self._engine.unmarked()
        nowhere = {i for i, n in Counter(i for _, i in unmarked).items() if n == len(self.replicas)}
        none_here = [i for i in nowhere if self.params[0][i].grad is None]
        if self._xproc is not None and self._engine.sync_enabled:
            # Every rank must launch the same buckets: a parameter without a
            # gradient here (None, or zeros the engine counts as none) is
            # reduced too, with zeros from here; which of them have a gradient
            # on no process at all is agreed meanwhile, and those return to
            # None after the reductions (_finish_across_processes).
            absent = sorted(set(none_here) | {i for i in nowhere if not self._engine.has_grad(i)})
            self._xproc.start_agreement(absent, len(self.names), self._agreement_record())
            self.backwards_since_sync = 0
            for i in absent:
                self._engine.note_grad(i, True)
                for views in self._views:
                    views[i].zero_()
            none_here = []
        for i in none_here:
            self._engine.note_grad(i, False)
            for views in self._views:  # None slices read zero (clipping sums buckets)
                views[i].zero_()
        for r, i in unmarked:
            grad, view = self.params[r][i].grad, self._views[r][i]
            if grad is view:
                continue
            if grad is None:
                view.zero_()
            else:
                self._adopt(self.params[r][i], view)

    def abort(self, reason: str = "abort() after a backward raised") -> None:
        """A replica's backward raised: drop the iteration (waits for in-flight
        reductions). Gradients are incomplete until the next zero_grad().
        Across processes the other ranks are told (they fail at once instead
        of at the timeout) and this GradSync refuses further steps."""
        if self._engine is not None:
            self._engine.abort()
        if self._xproc is not None:
            self._xproc.abandon(reason)

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
            self._use_current_stream(r)
        self.run_per_replica([partial(_zero, flats) for flats in self._flat], "zero_grad")
        self._engine.clear_grads(set_to_none)
        self._grad_versions = None

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
        self._align_grads()

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
        return list(self._flat[replica])

    @property
    def buckets(self) -> List[List[int]]:
        if self._engine is None:
            return [list(range(len(self.names)))]
        return [list(b) for b in self._engine.buckets]

    def stats(self) -> Dict[str, Any]:
        """The last synced iteration (DDP's definitions, see pyddp.observe) at the
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
        last reference does the same."""
        self._closed = True
        self._finalizer()

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


class _PrepareHook:
    """Replica r's forward pre-hook: prepare(r) before a forward that may be
    followed by backward. Holds the GradSync weakly. A copy of the module
    (copy.deepcopy, pickle, torch.save) must not carry a live pyddp hook, nor
    need pyddp to load: this hook copies as `functools.partial(dict.pop, {})`,
    a standard-library callable that returns the forward's arguments unchanged."""

    def __init__(self, sync: GradSync, replica: int):
        self.owner = weakref.ref(sync)
        self.replica = replica

    def __call__(self, module: nn.Module, args: Any) -> None:
        sync = self.owner()
        if sync is not None and torch.is_grad_enabled():
            sync.prepare(self.replica)

    def __reduce__(self) -> Any:
        return functools.partial, (dict.pop, {})


# Parameters synchronised by a live GradSync, by id (tensors cannot be weak
# dictionary keys: their == is elementwise): a second GradSync on the same
# parameters would reduce every gradient twice and fight over `param.grad`.
_SYNCED: Dict[int, Tuple[Any, Any]] = {}


def _note_synced(sync: GradSync) -> None:
    for key in [k for k, (p, s) in _SYNCED.items() if p() is None or s() is None]:
        del _SYNCED[key]
    for params in sync.params:
        for p in params:
            _SYNCED[id(p)] = (weakref.ref(p), weakref.ref(sync))


def _refuse_synced_twice(names: Sequence[str], params: Sequence[Sequence[torch.Tensor]]) -> None:
    for replica in params:
        for name, p in zip(names, replica):
            p_ref, sync_ref = _SYNCED.get(id(p), (None, None))
            other = sync_ref() if p_ref is not None and p_ref() is p else None
            if other is not None and not other.closed:
                raise ValueError(
                    f"parameter {name!r} is already synchronised by a live pyddp model or "
                    "GradSync (a model wrapped twice?): close() the first one, or wrap a copy "
                    "(copy.deepcopy(model))"
                )


def _check_identical(replicas: Sequence[nn.Module]) -> None:
    """GradSync sums gradients of identical replicas: replicas that start apart
    stay apart, silently. A one-time comparison of every parameter (frozen ones
    included) and buffer."""

    def state(m: nn.Module) -> Dict[str, torch.Tensor]:
        return {**dict(m.named_parameters()), **dict(m.named_buffers())}

    first = state(replicas[0])
    with torch.no_grad():
        for r, replica in enumerate(replicas[1:], start=1):
            mine = state(replica)
            if list(mine) != list(first):
                raise ValueError(
                    f"replica {r} has parameters and buffers {list(mine)[:5]}..., replica 0 has "
                    f"{list(first)[:5]}...: replicas must be copies of one model"
                )
            for name, t in mine.items():
                other = first[name].to(t.device)
                if t.shape != other.shape or not torch.equal(t, other):
                    gap = (
                        (t.double() - other.double()).abs().max().item()
                        if t.shape == other.shape
                        else float("nan")
                    )
                    raise ValueError(
                        f"replica {r}'s {name!r} differs from replica 0's (max abs difference "
                        f"{gap:.3g}): GradSync needs identical replicas. Copy replica 0's state "
                        "to the others (m.load_state_dict(m0.state_dict())), or pass "
                        "check_replicas=False if you make them equal yourself"
                    )


def _adopt(owner: Any, p: torch.Tensor, view: torch.Tensor) -> None:
    sync = owner()
    if sync is not None:
        sync._adopt(p, view)


def _release(handles: List[Any], engine: Optional[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()
    if engine is not None:
        engine.close()


def _in_turn(fns: Sequence[Callable[[], Any]], what: str) -> List[Any]:
    return [fn() for fn in fns]


def _zero(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        t.zero_()


_across_processes: weakref.WeakSet[GradSync] = weakref.WeakSet()


def _on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    # Any optimizer in the process; in one process nothing is registered.
    for sync in list(_across_processes):
        sync._count_step(optimizer)


register_optimizer_step_post_hook(_on_optimizer_step)

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_sum(t: torch.Tensor) -> int:
    """The sum of a tensor's raw bits as integers: equal for bitwise-equal
    tensors whatever the reduction order (integer addition associates)."""
    flat = t.detach().reshape(-1)
    kind = _BITS.get(flat.element_size())
    if kind is None or flat.is_complex():
        flat, kind = flat.view(torch.uint8), torch.uint8
    return int(flat.view(kind).sum(dtype=torch.int64))
