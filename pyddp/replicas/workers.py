"""Persistent per-replica worker threads: replica 0 runs on the caller's thread,
replica r > 0 on its own long-lived thread, so a step creates no threads. The
caller's grad mode, autocast regions and current CUDA streams go with every
task: a replica's forward runs on the stream the caller chose
(``with torch.cuda.stream(s)``),
so its backward and pyddp's zeroing of its buckets stay on one stream.

CPU replicas, and GPU replicas that share one GPU, may instead run in turn
on the caller's thread (wrap's `run_replicas`): where each op is small, the
hand-offs between threads and the interpreter lock passing between them at
every op cost more than the threads save. (Replicas sharing a GPU launch onto
the caller's streams of that GPU either way, as replica 0 always does from
the caller's thread, and replicas > 0 run with their GPU current either way;
replicas on several GPUs keep a thread each, its GPU current.) "auto" times
both ways for each kind of work (forward, backward, optimizer step, ...) and
keeps the faster for all (runtime/choice.py); the results are the same bytes either
way (each replica's work is the same, and the engine sums the replicas in a
fixed order)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..engine.hooks import InertCopy
from ..errors import ReplicaError
from ..runtime.choice import Choice
from .scatter import guard_sequence_first


class ReplicaWorkers:
    def __init__(
        self,
        num_replicas: int,
        threads: Optional[int] = None,
        devices: Optional[Sequence[torch.device]] = None,
        name: str = "pyddp",
        streams: Optional[Any] = None,
    ):
        # One single-thread executor per replica keeps that replica's work
        # ordered and on one thread (thread-local state such as CUDA streams).
        # torch's intra-op thread count is per thread: each worker sets its own
        # once, and replica 0's work on the caller's thread sets and restores it.
        self.threads = threads
        self.streams = streams  # a pyddp.engine.streams provider, or None (CPU)
        # Replicas > 0 on a CUDA device run with it current, on their threads
        # (_init_worker) and in turn alike (replica 0 with the caller's).
        self._gpu = [
            d if devices is not None and r > 0 and d.type == "cuda" else None
            for r, d in enumerate(devices or [None] * num_replicas)
        ]
        self._pools = [
            ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix=f"{name}-replica{r}",
                initializer=_init_worker,
                initargs=(threads, None if devices is None else devices[r]),
            )
            for r in range(1, num_replicas)
        ]

        self.mode = "threads"
        self._choice = Choice()
        self.running = "threads"  # how the run under way runs
        self._meet = False
        self._checkpointing: List[Any] = []  # transformers' layers with the flag
        self._guards: List[Any] = []  # hooks on the replicas' Dropout and sequence-first layers
        self.shard_rows: Optional[List[int]] = None  # the running forward's (run)
        self._guarded = False  # CPU replicas: guard_checkpointing
        self._probe = False  # "auto": the first forward runs in turn, looking for checkpointing
        self._dropout = False  # the replicas hold Dropout layers (guard_checkpointing)
        self._spotted = False

    def set_mode(
        self,
        mode: str,
        devices: Sequence[torch.device],
        meet: bool,
        gpus: Optional[Sequence[int]] = None,
    ) -> None:
        """ "threads", "in_turn" (every replica on the caller's thread, one
        after another) or "auto" (whichever is faster, timed per kind of work).
        In turn only where no replica needs a thread of its own (replicas
        on several GPUs: each its GPU current) or meets the others inside
        forward and backward (`meet`: SyncBatchNorm). `gpus`: the replicas'
        GPUs where they are GPU replicas (simulated ones are host tensors)."""
        why = ""
        on = set(gpus) if gpus is not None else {d for d in devices if d.type != "cpu"}
        if len(on) > 1:
            why = "replicas on several GPUs run on their own threads (each its GPU current)"
        elif meet:
            why = "SyncBatchNorm's replicas meet inside forward and backward, so they run at once"
        if why and mode == "in_turn":
            raise ValueError(f"run_replicas='in_turn': {why}; use 'auto' or 'threads'")
        self.mode = "threads" if why else mode
        self._choice = Choice()
        self._meet = bool(why)
        self._probe = self._guarded and self.mode == "auto"  # (threads if they meet)

    def guard_replicas(self, replicas: Sequence[torch.nn.Module], cpu: bool) -> None:
        """Several replicas in this process: a batch split along dim 0 that
        is a sequence-first layer's sequence is refused (scatter.py);
        on CPU replicas, Dropout under activation checkpointing (below)."""
        self._guards += guard_sequence_first(replicas, self)
        if cpu:
            self.guard_checkpointing(replicas)

    def guard_checkpointing(self, replicas: Sequence[torch.nn.Module]) -> None:
        """CPU replicas: activation checkpointing recomputes a segment's
        forward in backward with torch's CPU generator set back to its state
        at the forward, and replicas on threads share that generator, so a
        Dropout there would draw other masks than the forward's (wrong
        gradients, silently). Under "auto", a transformers model with
        gradient checkpointing on runs in turn (before_forward), as does a
        model whose first forward (run in turn, _probed) calls torch's
        checkpoint; under "threads" (chosen, or for SyncBatchNorm) a Dropout
        layer run inside a checkpointed forward or a recompute raises (other
        randomness there, torch.rand, is not seen). In turn the replicas
        draw one after another: exact. The hooks are removed at close()."""
        self._guarded = True  # (set_mode: the first forward's look under "auto")
        self._checkpointing = [m for m in replicas[0].modules() if _flag(m) is not None]
        guard = _DropoutGuard(self)  # (weak, and copied as nothing: the user's model)
        dropouts = [
            m.register_forward_pre_hook(guard)
            for replica in replicas
            for m in replica.modules()
            if isinstance(m, torch.nn.modules.dropout._DropoutNd)
        ]
        self._guards += dropouts
        self._dropout = bool(dropouts)

    def compiled(self) -> None:
        """The replicas are compiled: their forwards hide their callers from
        the first forward's look for checkpointing (and tracing it would
        change their graphs)."""
        self._probe = False

    def before_forward(self) -> None:
        """Under "auto": in turn for good where a transformers model turned
        gradient checkpointing on (see guard_checkpointing), or a model with
        Dropout runs under torch.use_deterministic_algorithms (dropout_drawn)."""
        if (
            self.mode == "auto"
            and not self._meet
            and (
                any(map(_flag, self._checkpointing))
                or self._dropout
                and torch.are_deterministic_algorithms_enabled()
            )
        ):
            self.mode = "in_turn"

    def dropout_drawn(self, module: torch.nn.Module) -> None:
        """A Dropout layer in training: replicas on threads draw their masks
        from torch's one CPU generator in no fixed order, so a run is not
        repeated bit for bit (a probe: -1.849 and -1.828 from one seed);
        under torch.use_deterministic_algorithms that is refused as torch
        refuses its own nondeterministic ops (warned with warn_only=True).
        Inside activation checkpointing it is refused always (see
        guard_checkpointing)."""
        if self.running == "in_turn" or not module.training or not module.p:
            return
        if torch.compiler.is_compiling():
            return  # (traced away: no graph break in a compiled replica)
        if torch.are_deterministic_algorithms_enabled():
            message = (
                "pyddp: a Dropout layer runs on CPU replicas running on threads, which draw "
                "their masks from torch's one CPU generator in no fixed order, so the run is "
                "not repeated bit for bit, and torch.use_deterministic_algorithms(True) asks "
                "for that. Wrap with run_replicas='auto' or 'in_turn' (the replicas then draw "
                "one after another; not with SyncBatchNorm, whose replicas meet on threads), "
                "or turn dropout off"
            )
            if not torch.is_deterministic_algorithms_warn_only_enabled():
                raise RuntimeError(message)
            warnings.warn(message, stacklevel=2)
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        checkpointed = hooks is not None and "checkpoint" in getattr(hooks[0], "__qualname__", "")
        if checkpointed or torch._C._current_graph_task_id() != -1:  # (a recompute in backward)
            raise RuntimeError(
                "pyddp: a Dropout layer runs inside activation checkpointing on CPU replicas "
                "running on threads: the recompute in backward sets torch's CPU generator back "
                "to its state at the forward, which the replicas share, so it would draw other "
                "masks than the forward did (wrong gradients). Wrap with run_replicas='in_turn' "
                "(the replicas then draw one after another and recompute exactly), or turn "
                "dropout off in the checkpointed layers"
            )

    def choices(self) -> Dict[str, str]:
        """How each kind of work runs now: "threads", "in_turn", or "trying"
        while "auto" still times both."""
        if self.mode != "auto":
            return {"*": self.mode}
        return {what: self._choice.chosen or "trying" for what in self._choice.kinds()}

    def runs_in_turn(self, what: str, settled: bool = True) -> bool:
        """Whether `what` runs in turn from now on (`settled`: not while
        "auto" tries), or else at its next run, a trial of "auto" included:
        a caller that runs it otherwise in turn (the optimizer's step once)
        makes the trial time what it will run once chosen."""
        if self.mode != "auto":
            return self.mode == "in_turn"
        if settled:
            return self._choice.chosen == "in_turn"
        self._choice.announced.add(what)
        return self._choice.upcoming(what) == "in_turn"

    def run(
        self, fns: Sequence[Callable[[], Any]], what: str, rows: Optional[List[int]] = None
    ) -> List[Any]:
        """Runs fns[r] for replica r, in parallel (or in turn, see the module);
        returns results in order. All replicas finish before this returns,
        even when one raises. `rows`: a forward's shares of the batch (split
        along dim 0), which the sequence-first guard reads while it runs."""
        self.shard_rows = rows
        try:
            return self._run(fns, what)
        finally:
            self.shard_rows = None

    def _run(self, fns: Sequence[Callable[[], Any]], what: str) -> List[Any]:
        if not self._pools and len(fns) > 1:
            raise RuntimeError("pyddp: this model was closed; wrap the model again to use it")
        # "auto" times the runs of every replica, and the runs of one where
        # its caller asked how the next runs (the optimizer's step once, in
        # a trial in turn): not a forward that reached replica 0 alone.
        if self._probe and what.startswith("forward") and len(fns) > 1:
            return self._probed(fns, what)
        if self.mode == "auto" and (len(fns) > 1 or what in self._choice.announced):
            how = self.running = self._choice.next(what)
            start = time.perf_counter()
            results = self._in_turn(fns, what) if how == "in_turn" else self._threads(fns, what)
            self._choice.took(what, how, time.perf_counter() - start)
            return results
        if len(fns) < 2 or self.mode == "threads":
            self.running = "threads"
            return self._threads(fns, what)
        self.running = "in_turn"
        return self._in_turn(fns, what)

    def _probed(self, fns: Sequence[Callable[[], Any]], what: str) -> List[Any]:
        """The first forward under "auto", in turn, with a hook on every
        module's forward looking for torch's checkpoint among its callers:
        found, every run is in turn from now on (guard_checkpointing)."""
        self._probe, self.running = False, "in_turn"
        handle = torch.nn.modules.module.register_module_forward_pre_hook(self._spot)
        try:
            return self._in_turn(fns, what)
        finally:
            handle.remove()
            if self._spotted:
                self.mode = "in_turn"

    def _spot(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return  # (traced away: no graph break in a compiled replica)
        frame = sys._getframe(1)
        while frame is not None and not self._spotted:
            self._spotted = frame.f_code.co_filename.endswith(_CHECKPOINT_FILE)
            frame = frame.f_back

    def _in_turn(self, fns: Sequence[Callable[[], Any]], what: str) -> List[Any]:
        """Every replica's work on the caller's thread, in replica order, at
        the replicas' intra-op thread count (as replica 0 on threads: an
        OpenMP team of another size beside the workers' oversubscribes the
        cores and stops libgomp spinning process-wide, so the cost of one
        kind of work would land in another's). As with threads, every
        replica runs even when one raises (a Ctrl-C stops at once: the
        interrupted step is dropped)."""
        results: List[Any] = [None] * len(fns)
        first: Optional[ReplicaError] = None
        with self._replica_threads():
            for r, fn in enumerate(fns):
                gpu = self._gpu[r]
                try:
                    if gpu is None:
                        results[r] = fn()
                    else:
                        with torch.cuda.device(gpu):
                            results[r] = fn()
                except Exception as e:  # re-raised below, after every replica ran
                    if first is None:
                        first = ReplicaError(r, what, e)
        if first is not None:
            raise first from first.cause
        return results

    def _threads(self, fns: Sequence[Callable[[], Any]], what: str) -> List[Any]:
        grad = torch.is_grad_enabled()
        regions = _caller_regions() if len(fns) > 1 else ()
        streams = self.streams.snapshot() if self.streams is not None and len(fns) > 1 else None
        futures: List[Optional[Future]] = [None]
        for r in range(1, len(fns)):
            # Grad mode and current streams are thread-local: carry the caller's.
            futures.append(
                self._pools[r - 1].submit(
                    _with_caller_state, grad, regions, self.streams, streams, fns[r]
                )
            )
        results: List[Any] = [None] * len(fns)
        first: Optional[ReplicaError] = None
        interrupt: Optional[BaseException] = None
        if fns:
            try:
                with self._replica_threads():
                    results[0] = fns[0]()
            except Exception as e:  # re-raised below, after every replica is done
                first = ReplicaError(0, what, e)
            except BaseException as e:  # KeyboardInterrupt: also only once all are done
                interrupt = e
        for r in range(1, len(fns)):
            try:
                results[r] = futures[r].result()
            except Exception as e:
                # The replica that failed first, not one that stopped because
                # it did (a broken SyncBatchNorm meeting says `consequence`).
                if first is None or getattr(first.cause, "consequence", False):
                    first = ReplicaError(r, what, e)
        if interrupt is not None:
            raise interrupt
        if first is not None:
            raise first from first.cause
        return results

    @contextlib.contextmanager
    def _replica_threads(self) -> Iterator[None]:
        """The caller's thread at a replica's intra-op thread count, then back."""
        caller_threads = torch.get_num_threads()
        switch = self.threads is not None and self.threads != caller_threads
        if switch:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            if switch:
                torch.set_num_threads(caller_threads)

    def close(self, wait: bool = True) -> None:
        for handle in self._guards:
            handle.remove()
        self._guards = []
        for pool in self._pools:
            pool.shutdown(wait=wait)  # wait=False: safe from any thread (a collection)
        self._pools = []


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


class _DropoutGuard(InertCopy):
    """ReplicaWorkers.guard_checkpointing's hook on the Dropout layers,
    holding the workers weakly."""

    def __init__(self, workers: ReplicaWorkers) -> None:
        self.owner = weakref.ref(workers)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        workers = self.owner()
        if workers is not None:
            workers.dropout_drawn(module)


def _flag(module: torch.nn.Module) -> Any:
    """transformers' gradient_checkpointing flag on a layer, or None."""
    flag = module.__dict__.get("gradient_checkpointing")
    return flag if isinstance(flag, bool) else None


def _init_worker(threads: Optional[int], device: Optional[torch.device]) -> None:
    if threads is not None:
        # torch re-applies, at a thread's first parallel op, the count the last
        # set_num_threads in *any* thread chose, unless this thread already
        # made one: get_num_threads() initialises it, so this worker keeps its
        # own count instead of the caller's (a second OpenMP team at 2 threads
        # oversubscribes the cores and stops libgomp spinning process-wide).
        torch.get_num_threads()
        torch.set_num_threads(threads)
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # allocations without a device land on the replica's


def _caller_regions() -> Tuple[Callable[[], Any], ...]:
    """The caller's autocast regions (thread-local, like grad mode), each a
    context to enter again on a worker. Saved-tensor hooks
    (`torch.autograd.graph.saved_tensors_hooks`) are thread-local too and
    stay with replica 0: carried to the workers, they ran on several threads
    at once (a stateful offloader's ids crossed replicas) and
    `checkpoint(dmodel, ...)` recomputed the wrapped model from a worker
    (a hang; a review). In turn every replica runs under them."""
    return tuple(
        functools.partial(
            torch.autocast,
            kind,
            dtype=torch.get_autocast_dtype(kind),
            cache_enabled=torch.is_autocast_cache_enabled(),
        )
        for kind in ("cpu", "cuda")
        if torch.is_autocast_enabled(kind)
    )


def _with_caller_state(
    enabled: bool,
    regions: Tuple[Callable[[], Any], ...],
    provider: Optional[Any],
    streams: Optional[Any],
    fn: Callable[[], Any],
) -> Any:
    with torch.set_grad_enabled(enabled), contextlib.ExitStack() as stack:
        for region in regions:
            stack.enter_context(region())
        if provider is not None and streams is not None:
            stack.enter_context(provider.use(streams))
        return fn()
