"""GradSync: gradient synchronisation for replica modules the caller already
placed, the public API that other training loops embed (docs/embedding.md).
It is a face over the reducer (reducer.py), which `pyddp.wrap` drives
directly; its options are `Options`' fields (options.py), each documented
there once."""

from __future__ import annotations

import warnings
from operator import attrgetter, methodcaller
from typing import Any, ContextManager, Dict, List, Sequence

import torch
from torch import nn

from .faces import open_backward
from .observe import ReadyTimes
from .options import Options
from .params import assemble
from .reducer import Reducer

_REQUIRES_GRAD = attrgetter("requires_grad")


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

    Options (keywords): the fields of ``pyddp.engine.options.Options`` but
    wrap's own two (broadcast_buffers, threads_per_replica), each documented
    under its field: bucket_cap_mb, first_bucket_cap_mb, taper_buckets,
    reduce_order, rebuild_buckets, op, timeout_s, timeline, check_replicas,
    group, find_unused_parameters, static_graph. An unknown or invalid one
    raises, naming itself.

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

    def __init__(self, replicas: Sequence[nn.Module], **options: Any):
        if isinstance(replicas, nn.Module):  # (iterating a Sequential gives its layers)
            raise TypeError(
                f"replicas must be a list of modules, one per replica, got one "
                f"{type(replicas).__name__}: pass [model, copy.deepcopy(model), ...]"
            )
        replicas = list(replicas)
        if not replicas:
            raise ValueError("replicas is empty: pass at least one module")
        for m in replicas:
            if not isinstance(m, nn.Module):
                raise TypeError(f"replicas must be torch.nn.Module objects, got {type(m).__name__}")
        parts = assemble(replicas, Options.for_sync(options))
        self._reducer = Reducer(parts, prepare_on_forward=True)
        self._replicas = replicas  # check_step: what would train unreduced
        self._reduced = {id(p) for ps in parts.params for p in ps}
        self._params, self._names = parts.params, parts.names  # check_step: frozen on some
        if self._reducer.reduces and any(
            isinstance(m, nn.SyncBatchNorm) for r in replicas for m in r.modules()
        ):
            # GradSync reduces gradients only: the layers would normalize per
            # replica (one process) or raise (torch's, on CPUs).
            warnings.warn(
                "pyddp.GradSync does not synchronize SyncBatchNorm statistics across its "
                "replicas (only gradients): use pyddp.wrap, which does",
                stacklevel=2,
            )

    # ------------------------------------------------------------- each step
    def finish(self) -> None:
        """End of backward: reduces what is left (unused parameters), waits for every
        reduction, and leaves parameters nobody produced a gradient for at None.
        Raises ReduceError (naming bucket and parameters) if a reduction failed.
        Call check_step() before stepping: it copies what you change on replica
        0's gradients after finish() (clipping, unscaling) to every replica."""
        self._reducer._check_open()  # (closed: said so, not as a reduction cut short)
        self._reducer.finish()

    def abort(self, reason: str = "abort() after a backward raised") -> None:
        """A replica's backward raised: drop the iteration (waits for in-flight
        reductions). Gradients are incomplete until the next zero_grad().
        Across processes the other ranks are told (they fail at once instead
        of at the timeout) and this GradSync refuses further steps."""
        self._reducer.abort(reason)

    def no_sync(self) -> ContextManager[None]:
        """Backwards inside accumulate locally; the next synced backward reduces
        the accumulated sum. The backward must run inside the block."""
        self._reducer._check_open()
        return self._reducer.no_sync()

    def check_step(self) -> None:
        """Raises if stepping now would let replicas diverge, including for a GPU
        reduction that failed or timed out after finish() returned, and for a
        gradient this GradSync does not reduce (a parameter frozen at
        construction and unfrozen since, or added since), and for a parameter
        frozen on some replicas only (their share would count as zeros): one
        pass over the parameters."""
        self._reducer.check_step()
        if not self._reducer.reduces:
            return
        trainable = [list(map(_REQUIRES_GRAD, ps)) for ps in self._params]  # C-level per parameter
        if trainable.count(trainable[0]) != len(trainable):
            j = next(j for j, ps in enumerate(zip(*trainable)) if len(set(ps)) > 1)
            frozen = [r for r, ps in enumerate(trainable) if not ps[j]]
            raise RuntimeError(
                f"pyddp: parameter {self._names[j]!r} is frozen (requires_grad=False) on "
                f"replica(s) {frozen} only: their share of its gradient counts as zeros; "
                "freeze or unfreeze it on every replica"
            )
        self._refuse_replaced_on_others()
        self._refuse_moved_storage()
        for r, replica in enumerate(self._replicas):
            for name, p in replica.named_parameters():
                if p.requires_grad and p.grad is not None and id(p) not in self._reduced:
                    raise RuntimeError(
                        f"pyddp: parameter {name!r} of replica {r} has a gradient this GradSync "
                        "does not reduce (frozen when it was built and unfrozen since, or added "
                        "since): stepping would let the replicas diverge; close it and build a "
                        "new GradSync after such a change"
                    )

    def _refuse_replaced_on_others(self) -> None:
        """A gradient assigned on replica 0 after finish() is copied to every
        replica at the step (align); one replaced on another replica
        (assigned, or set to None) would step that replica on its own."""
        layout = self._reducer._layout
        if layout is None or layout.scattered is not None:
            return
        grads0 = [p.grad for p in self._params[0]]
        for r in range(1, len(self._params)):
            for i, (p, view) in enumerate(zip(self._params[r], layout.views[r])):
                g = p.grad
                if g is not view and not (g is None and grads0[i] is None):
                    raise RuntimeError(
                        f"pyddp: the gradient of {self._names[i]!r} on replica {r} was replaced "
                        "(assigned, or set to None) after finish(): stepping would let the "
                        "replicas diverge. Change gradients on replica 0 (in place or by "
                        "assignment: they are copied to every replica before the step), or on "
                        "every replica in place"
                    )

    def _refuse_moved_storage(self) -> None:
        """Module._apply (share_memory(), .double().float()) or `p.grad.data =`
        gave a replica's gradients storage outside its buckets since they
        were laid out: the reduction did not reach them (reattach())."""
        layout = self._reducer._layout
        if layout is None or layout.scattered is not None:
            return
        storage, ptr = methodcaller("untyped_storage"), methodcaller("data_ptr")
        for r, (views, flats) in enumerate(zip(layout.views, layout.flat)):  # (C-level passes)
            if not set(map(ptr, map(storage, views))) <= set(map(ptr, map(storage, flats))):
                raise RuntimeError(
                    f"pyddp: cannot step: the gradients of replica {r} were given new "
                    "storage after this GradSync laid out its buckets (Module._apply: "
                    "share_memory(), .double().float(); or p.grad.data = ...), so the "
                    "reduction did not reach them; call sync.reattach() after such calls. "
                    "Now: sync.zero_grad(), sync.reattach(), and run the step again"
                )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears every replica's gradients. set_to_none (the default): every
        param.grad is None, as torch's; the next backward's gradients are
        copied into the buckets as they arrive (a parameter that gets none
        stays None). set_to_none=False: the buckets are zeroed and param.grad
        keeps pointing into them (docs/semantics.md, zero_grad)."""
        self._reducer.zero_grad(set_to_none)

    # ---------------------------------------------------------- the gradients
    def flat_grads(self, replica: int) -> List[torch.Tensor]:
        """Tensors holding all of one replica's gradients, for in-place ops: the
        flat bucket buffers (None ones read as zeros), or with one replica the
        gradients themselves."""
        n = len(self._replicas)
        if isinstance(replica, bool) or not isinstance(replica, int) or not 0 <= replica < n:
            raise IndexError(f"flat_grads({replica!r}): replica must be an int in [0, {n})")
        return self._reducer.flat_grads(replica)

    @property
    def buckets(self) -> List[List[int]]:
        """The bucket plan: each bucket's parameter indices (in the order of
        the replicas' trainable parameters)."""
        return self._reducer.buckets

    def reattach(self) -> None:
        """Points every gradient into fresh bucket buffers again, keeping the
        values: after `Module._apply` (share_memory(), .to(memory_format=...),
        .half().float()) replaced parameter and gradient storage."""
        self._reducer.reattach()

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
        self._reducer.register_comm_hook(state, hook)

    # ------------------------------------------------------------ measuring
    def stats(self) -> Dict[str, Any]:
        """The last synced iteration (DDP's definitions, see pyddp.engine.observe) at the
        top level, running means under "mean", and the iteration count. GPU
        replicas add "gpu" (per device: host and GPU ms per backward, and
        whether the host bounds the step; engine.observe.GpuClock) and, where
        the host does, "gpu_advice"."""
        return self._reducer.stats()

    def export_timeline(self, path: Any) -> Any:
        """Writes the kept iterations as Chrome trace JSON (open in Perfetto or
        chrome://tracing) and returns the path."""
        return self._reducer.export_timeline(path)

    def ready_times(self) -> ReadyTimes:
        """When each of replica 0's gradients became ready in the last kept
        iteration (needs timeline=N), relative to the end of forward, with
        backward's length: the profile `pyddp.bench.simulator` scales up. On
        GPUs these are when autograd's hooks ran on the host."""
        return self._reducer.ready_times()

    # ------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Removes the hooks and releases the backend's threads and GPU
        communicators; gradients stay where they are. Idempotent; dropping the
        last reference does the same. Across processes on GPUs, the last
        agreement's sums are checked first (raises if the ranks' work differed).
        Closed while a backward is under way (finish() not called), it warns:
        the replicas keep different, unreduced gradients (a probe: silent)."""
        r = self._reducer
        if not r.closed and open_backward(r):
            warnings.warn(
                "pyddp: GradSync closed while a backward was under way (finish() not "
                "called): the replicas keep different, unreduced gradients; zero them "
                "before they are stepped",
                stacklevel=2,
            )
        r.close()

    @property
    def closed(self) -> bool:
        return self._reducer.closed

    def __enter__(self) -> GradSync:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._reducer.__reduce_ex__(protocol)
