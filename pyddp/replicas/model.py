"""`pyddp.wrap(model, devices)`: persistent replicas driven from one process.
Forward scatters the batch, runs every replica on its own persistent worker and
gathers outputs on devices[0]; backward through the gathered output (or the
per-replica loss) runs every replica's backward and reduces gradients during it
through GradSync."""

from __future__ import annotations

import contextlib
import copy
import weakref
from functools import partial
from typing import (
    Any,
    Callable,
    ContextManager,
    Dict,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    Type,
)

import torch
from torch import nn

from .._link.control import BUFFERS_BROADCAST
from .._link.ranks import Ranks
from ..engine.options import Options
from ..engine.reducer import Reducer
from ..errors import ReplicaError
from ..optim.factory import ParamsFn, make_optimizer
from ..runtime.devices import DeviceLike, parse_devices, process_devices
from ..runtime.libraries import timeout_s
from ..runtime.torchrun import refuse_training_alone
from .ddp_args import wrap_options
from .gather_node import Join, join_column
from .mirror import ReplicaMirror
from .scatter import batch_size, call_arguments, gather, scatter
from .syncbn import SyncBatchNorms, sync_layers
from .uneven import Joinable, Joining
from .workers import ReplicaWorkers


class DistributedModel(nn.Module, Joining):
    """A model replicated over `devices`; see `pyddp.wrap`."""

    def __init__(
        self,
        module: nn.Module,
        devices: Optional[Sequence[DeviceLike]] = None,
        *,
        _options: Optional[Options] = None,
        **options: Any,
    ):
        super().__init__()
        Joinable.__init__(self)  # torch's Join: disabled until a Join enables it
        if isinstance(module, DistributedModel):
            raise TypeError(
                "the model is already wrapped (a pyddp DistributedModel): use it as it is, or "
                "wrap its .module after closing it"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            raise TypeError(
                f"the model is already wrapped in torch's {type(module).__name__}: wrap its "
                ".module instead (pyddp replaces it; two data-parallel wrappers would reduce "
                "every gradient twice)"
            )
        if _options is None:
            _options = Options.for_wrap(wrap_options(options, "pyddp.wrap", placed=False))
        opts = _options
        if opts.group is None:
            refuse_training_alone()  # before any replica is copied to a device
        self.devices: List[torch.device] = (
            process_devices(opts.group) if devices is None else parse_devices(devices)
        )
        self.module = module.to(self.devices[0])
        replicas = [self.module] + [copy.deepcopy(self.module).to(d) for d in self.devices[1:]]
        # A plain list, not submodules: parameters() and state_dict() show one copy.
        self._replicas: List[nn.Module] = replicas
        self._callables: List[Callable[..., Any]] = list(replicas)  # compiled by compile()
        # opts has check_replicas=False: deep copies of replica 0. _begin
        # prepares every replica; no hook on the user's model (a hook there
        # would also sit inside `dmodel.compile()`'s graphs).
        self._reducer = Reducer(replicas, opts, prepare_on_forward=False)
        try:
            self._mirror = (
                ReplicaMirror(replicas, self._reducer.names) if len(replicas) > 1 else None
            )
        except BaseException:
            self._reducer.close()  # no hooks left behind on the user's model
            raise
        self.broadcast_buffers = opts.broadcast_buffers
        threads_per_replica = opts.threads_per_replica
        if threads_per_replica is None and len(replicas) > 1 and self.devices[0].type == "cpu":
            # CPU replicas compute at once: share the cores instead of every
            # replica using torch's full intra-op count (oversubscription).
            threads_per_replica = max(1, torch.get_num_threads() // len(replicas))
        self._workers = ReplicaWorkers(
            len(replicas), threads_per_replica, self.devices, streams=self._reducer.streams
        )
        self._reducer.run_per_replica = self._workers.run
        # CPU replicas: autograd would run every replica's backward on the one
        # calling thread, so backward is dispatched to the replica workers.
        # CUDA replicas get a thread per device from autograd itself.
        self._parallel_backward = len(replicas) > 1 and self.devices[0].type == "cpu"
        # One replica and one process: nothing to scatter, join or reduce.
        self._passthrough = not self._reducer.reduces
        self._finish_queued = False
        self._syncbn: Optional[SyncBatchNorms] = None
        self._optimizers: List[weakref.ref] = []  # dmodel.optimizer's, for Join's end
        self._apart_after_join = ""  # why training is refused after Join (optim/after_join.py)
        self._buffers_due = False  # rank 0's buffers to every rank after this backward
        self._output_in_backward = False  # the running backward went through a dmodel output
        if sync_layers(self.module) and not self._passthrough:
            self._syncbn = self._bind_sync_batchnorm(replicas, opts)
        if len(replicas) == 1 and not self._passthrough:
            self._reducer.on_backward_start = weakref.WeakMethod(self._backward_began)

    def _bind_sync_batchnorm(self, replicas: List[nn.Module], opts: Options) -> SyncBatchNorms:
        gpus = self._reducer.gpu_devices
        try:
            return SyncBatchNorms(
                replicas,
                self.devices[0],
                self._reducer.link.stats_summer(),
                opts.timeout_s or timeout_s(),
                None if gpus is None else (gpus, self._reducer.streams),
            )
        except BaseException:
            self._reducer.close()
            raise

    # ---------------------------------------------------------------- access
    @property
    def replicas(self) -> List[nn.Module]:
        return list(self._replicas)

    @property
    def ranks(self) -> Ranks:
        """The processes this model spans (`pyddp._link.ranks.Ranks`): this
        rank, the world, and the collective exchanges the Trainer makes."""
        return Ranks(self._reducer.link)

    @property
    def last_global_loss(self) -> Optional[float]:
        """Across processes, on CPU replicas: the global batch's loss of the
        last training step's dmodel.loss, known once its backward finished
        (None in one process, and on GPUs, where reading it would make the
        host wait)."""
        return self._reducer.link.global_loss

    def optimizer(
        self,
        cls: Optional[Type[torch.optim.Optimizer]] = None,
        params: Optional[ParamsFn] = None,
        *,
        shard: bool = False,
        optimizer_class: Optional[Type[torch.optim.Optimizer]] = None,
        **kwargs: Any,
    ) -> torch.optim.Optimizer:
        """One optimizer stepping every replica (an instance of `cls`'s subclass).
        `params`, if given, maps a replica module to its parameters or groups.
        `shard=True`: ZeRO stage 1 (pyddp.optim.zero): each replica of each process
        holds optimizer state for its share of the parameters only, and
        state_dict() is the unsharded one's (CPU replicas)."""
        self._check_open()
        if (cls is None) == (optimizer_class is None):
            raise TypeError(
                "dmodel.optimizer takes the optimizer class once: as its first argument, or "
                "as optimizer_class= (torch's ZeroRedundancyOptimizer spelling)"
            )
        opt = make_optimizer(self._reducer, cls or optimizer_class, params, shard, **kwargs)
        if not shard:  # a sharded one cannot step under Join (zero.py)
            self._optimizers.append(weakref.ref(opt))
        return opt

    def optimizers_made(self) -> List[torch.optim.Optimizer]:
        """The optimizers dmodel.optimizer made that are still alive, in the
        order made (Join aligns them to the last joiner's at its end)."""
        alive = [o for o in (ref() for ref in self._optimizers) if o is not None]
        self._optimizers = [weakref.ref(o) for o in alive]
        return alive

    def no_sync(self):
        """Backwards inside accumulate without reducing; the next synced backward
        reduces the accumulated sum."""
        self._check_open()
        return self._reducer.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reducer.zero_grad(set_to_none)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """torch DDP's register_comm_hook (see GradSync.register_comm_hook):
        e.g. `dmodel.register_comm_hook(None, "bf16")`."""
        self._check_open()
        self._reducer.register_comm_hook(state, hook)

    def stats(self) -> Dict[str, Any]:
        """Last iteration's communication figures and running means (GradSync.stats)."""
        return self._reducer.stats()

    def export_timeline(self, path: Any) -> Any:
        """Chrome trace JSON of the kept iterations (wrap(..., timeline=N))."""
        return self._reducer.export_timeline(path)

    def ready_times(self) -> Any:
        """When each gradient became ready in the last kept iteration
        (GradSync.ready_times; wrap with timeline=N)."""
        return self._reducer.ready_times()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips every replica's gradients by their global norm and returns that
        norm: the norm of the full-batch gradient, not sqrt(N) times it."""
        self._check_open()
        if len(self._replicas) == 1:
            return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, norm_type)
        flats = self._reducer.flat_grads(0)  # replicas hold the same reduced values
        norms = [
            torch.linalg.vector_norm(
                f, norm_type, dtype=torch.promote_types(f.dtype, torch.float32)
            )
            for f in flats
        ]
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for r in range(len(self._replicas)):
            grads = self._reducer.flat_grads(r)
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return total

    def train(self, mode: bool = True) -> DistributedModel:
        super().train(mode)
        for m in self._replicas[1:]:
            m.train(mode)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """The wrapped model's state dict (replica 0; keys without a prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Dict[str, Any], strict: bool = True, assign: bool = False
    ):
        self._check_open()
        if assign:
            raise ValueError("assign=True would detach the replicas from their gradient buffers")
        result = self.module.load_state_dict(state_dict, strict=strict)
        for m in self._replicas[1:]:
            m.load_state_dict(state_dict, strict=strict)
        return result

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Runs every replica through `torch.compile(replica, *args, **kwargs)`
        from now on; the scatter, threads and gather stay eager, and calling
        `.module` directly stays uncompiled. Equivalent to wrapping a compiled
        model, and the way to compile after wrap: `torch.compile(dmodel)` would
        trace pyddp's own threads and break its graph there."""
        self._check_open()
        self._callables = [torch.compile(m, *args, **kwargs) for m in self._replicas]

    def close(self) -> None:
        """Stops the worker threads, removes the gradient hooks and releases the
        backend (threads, GPU communicators). The model (`.module`) stays usable
        on its own; this wrapper raises if used again. Idempotent; dropping the
        last reference, or leaving a `with pyddp.wrap(...) as dmodel:` block,
        does the same."""
        self._workers.close()
        self._reducer.close()
        if getattr(self, "_syncbn", None) is not None:
            self._syncbn.release()  # torch's SyncBatchNorm again

    def __enter__(self) -> DistributedModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a wrapped model holds threads and per-replica state and cannot be pickled, copied "
            "or torch.save()d: save dmodel.state_dict() (or dmodel.module), copy dmodel.module"
        )

    def _check_open(self) -> None:
        if self._reducer.closed:
            raise RuntimeError(
                "pyddp: this wrapped model was closed; use .module on its own, or wrap it again"
            )

    # --------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Scatters tensors along dim 0, runs the replicas in parallel, gathers
        outputs on devices[0]. Reduce the loss with a mean over the whole batch and
        gradients equal single-device training on it."""
        self._check_open()
        if self._passthrough:
            return self.module(*args, **kwargs)
        self._notify_join()
        with self._abandon_on_error("forward"):
            shards, sizes = self._start((args, kwargs))
            with self._sync_batchnorm(len(shards)):
                outs = self._workers.run(
                    [self._call(r, a, kw) for r, (a, kw) in enumerate(shards)], "forward"
                )
        if torch.is_grad_enabled():
            self._reducer.note_forward_end()
        return gather(outs, sizes, self.devices[0], self._join)

    def loss(
        self,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        inputs: Any,
        targets: Any,
        *,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """Computes `loss_fn(replica(shard inputs), shard targets)` on each
        replica's own device, without gathering outputs, and returns the full-batch
        loss on devices[0]. With reduction="mean" (loss_fn averages over its shard)
        shards are weighted by their sizes, so uneven shards give the full-batch
        mean; with "sum" (loss_fn sums) the shard losses are added. `inputs` is the
        model's argument, a tuple of its positional arguments, or a dict of its
        keyword arguments (pass a dict argument as a 1-tuple: `(d,)`)."""
        self._check_open()
        args, kwargs = call_arguments(inputs)  # checked here, not on every replica
        if self._passthrough:
            _check_reduction(reduction)
            return _checked(loss_fn(self.module(*args, **kwargs), targets))
        with self._abandon_on_error("forward/loss"):
            shards, _ = scatter((inputs, targets), self.devices)
        return self.loss_on_shards(loss_fn, shards, reduction=reduction)

    def loss_on_shards(
        self,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        shards: Sequence[Tuple[Tuple[Any, ...], Any]],
        *,
        reduction: str = "mean",
        context: Optional[Callable[[], ContextManager[Any]]] = None,
    ) -> torch.Tensor:
        """Like `loss`, for batches already split and placed on the replicas'
        devices (per-device data loading): shards[r] = (inputs, targets) for
        replica r, inputs as in `loss`; fewer shards than replicas leaves the rest
        out. `context`, if
        given, is entered on each replica's thread around its forward and loss
        (e.g. autocast, which is thread-local)."""
        self._check_open()
        _check_reduction(reduction)
        if not 1 <= len(shards) <= len(self._replicas):
            raise ValueError(f"got {len(shards)} shards for {len(self._replicas)} replicas")
        sizes = [batch_size(args) for args, _ in shards]
        total = sum(sizes)
        self._notify_join()
        self._begin(total)

        def replica_loss(r: int) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                shard_inputs, shard_targets = shards[r]
                args, kwargs = call_arguments(shard_inputs)
                with context() if context is not None else contextlib.nullcontext():
                    out = self._callables[r](*args, **kwargs)
                    value = _checked(loss_fn(out, shard_targets))
                return value * (sizes[r] / total) if reduction == "mean" else value

            return run

        with self._abandon_on_error("forward/loss"), self._sync_batchnorm(len(shards)):
            losses = self._workers.run(
                [self._breaking_meetings(r, replica_loss(r)) for r in range(len(shards))],
                "forward/loss",
            )
        # Training steps only: an evaluation (eval mode) may run on some ranks alone.
        if self.training and torch.is_grad_enabled():
            losses = self._reducer.link.weigh_losses(
                losses, total, reduction, self._reducer.syncing
            )
        if torch.is_grad_enabled():
            self._reducer.note_forward_end()
        if self._passthrough or not any(v.requires_grad for v in losses):
            return join_column(losses, "sum", self.devices[0], [])
        return self._join([[v] for v in losses], ["sum"], [])[0]

    @contextlib.contextmanager
    def _abandon_on_error(self, what: str) -> Iterator[None]:
        """Across processes, a training forward that raises here leaves the
        other ranks waiting for this rank's step: they are told at once (and
        this wrapper refuses further steps) instead of pairing our next step
        with theirs."""
        try:
            yield
        except BaseException as e:
            if self._reducer.link.spans_processes and torch.is_grad_enabled():
                self._reducer.abort(f"its {what} raised {type(e).__name__}: {e}")
            raise

    def _join(
        self, tensors: List[List[torch.Tensor]], kinds: List[str], weights: Any
    ) -> List[torch.Tensor]:
        """Joins per-replica tensors on devices[0] through autograd: backward
        through the result runs every replica's backward (_backward)."""
        join = Join(
            tensors, kinds, self.devices[0], weights, self._backward, self._parallel_backward
        )
        return list(join.apply())

    def map_replicas(
        self, fn: Callable[[int, nn.Module, Any], Any], shards: Sequence[Any], what: str = "map"
    ) -> List[Any]:
        """Runs fn(r, replica r, shards[r]) on every replica's worker, in parallel
        (e.g. sharded evaluation); returns the results in replica order."""
        self._check_open()
        if self._mirror is not None:
            self._follow_model()
        return self._workers.run(
            [partial(fn, r, self._callables[r], shard) for r, shard in enumerate(shards)], what
        )

    def _start(self, tree: Any) -> Tuple[List[Any], List[int]]:
        """Scatters `tree` and readies the replicas for a new iteration."""
        shards, sizes = scatter(tree, self.devices)
        self._begin(sum(sizes))
        return shards, sizes

    def _begin(self, rows: int) -> None:
        """Readies the replicas for a forward of `rows` rows that may be
        followed by backward."""
        if self._passthrough:
            return
        self.training = self.module.training
        if torch.is_grad_enabled():
            if self._apart_after_join:
                raise RuntimeError(self._apart_after_join)  # on every rank alike
            self._finish_queued = False  # a backward that raised never ran its callback
            self._output_in_backward = False
            self._reducer.prepare_all()
        self._follow_model()
        if torch.is_grad_enabled():
            self._buffers_due = (
                self.broadcast_buffers
                and self._reducer.link.spans_processes
                and self.module.training
                and self._reducer.syncing
            )
        self._join_forward(rows)  # under Join: what the joined ranks shadow
        # Training forwards (DDP's default) and eval forwards alike: replicas > 0
        # updated their own BatchNorm statistics in their last training forward.
        self.broadcast_buffers_now()

    def _follow_model(self) -> None:
        """Brings the other replicas in line with the user's model (replica 0)."""
        if self._mirror is None:
            return
        if self._mirror.follow() or self._reducer.grads_moved():
            # Module._apply gave parameters new storage (share_memory(),
            # .to(memory_format=...), .half().float()), and their gradients
            # with them: the gradients must point into the buckets again, and
            # every parameter is copied (a new tensor may reuse the old
            # address, so pointers alone do not show which ones changed).
            self._reducer.reattach()
            self._mirror.copy_all()

    def sync_replicas(self) -> None:
        """Copies replica 0's parameters and buffers to every other replica.
        Needed only after changing values where torch's version counters do not
        see it (`p.data.normal_()`, writes through `.data` or numpy); every other
        change to the model is followed at the next forward."""
        self._check_open()
        if self._mirror is not None:
            self._mirror.copy_all()
            self._copy_buffers()

    def broadcast_buffers_now(self) -> None:
        """Copies replica 0's buffers (BatchNorm statistics) to this
        process's other replicas, if broadcast_buffers is on: before every
        forward, so every replica runs with replica 0's. Across processes
        they were made rank 0's at the end of the last synced training
        backward (_buffers_after_backward)."""
        if self.broadcast_buffers:
            self._copy_buffers()

    def _buffers_after_backward(self) -> None:
        """torch DDP's buffer rule, across processes: after a synced training
        forward (grad enabled, not under no_sync()), rank 0's buffers (the
        highest rank with inputs under Join) go to every rank. DDP sends
        them before the next forward, whatever its mode; pyddp sends the
        same values at the end of that forward's backward (not earlier: the
        backward may read buffers its forward saved), so an evaluation that
        follows sees DDP's statistics on every rank without communicating,
        and may still run on some ranks only."""
        if self._buffers_due:
            self._buffers_due = False
            self._reducer.link.broadcast(list(self.module.buffers()), BUFFERS_BROADCAST)
            if len(self._replicas) > 1:
                self._copy_buffers()  # this process's other replicas too, at once

    def _copy_buffers(self) -> None:
        self._check_open()
        with torch.no_grad():
            sources = list(self.module.buffers())
            for m in self._replicas[1:]:
                for mine, src in zip(m.buffers(), sources):
                    mine.copy_(src)

    def _call(self, r: int, args: Any, kwargs: Any) -> Callable[[], Any]:
        return self._breaking_meetings(r, lambda: self._callables[r](*args, **kwargs))

    def _sync_batchnorm(self, replicas: int) -> ContextManager[None]:
        """SyncBatchNorm layers meet in this forward (not in forwards outside
        pyddp, nor in evaluation), between replicas 0..`replicas`-1; the
        backward of this forward meets between the same."""
        if self._syncbn is None:
            return contextlib.nullcontext()
        return self._syncbn.meetings(replicas)

    def _breaking_meetings(self, r: int, fn: Callable[[], Any]) -> Callable[[], Any]:
        """fn, which on failure breaks SyncBatchNorm's meetings: the other
        replicas raise instead of waiting for this one."""
        if self._syncbn is None:
            return fn
        exchange = self._syncbn.exchange

        def run() -> Any:
            try:
                return fn()
            except BaseException as e:
                exchange.abort(f"replica {r} raised {type(e).__name__}: {e}")
                raise

        return run

    # -------------------------------------------------------------- backward
    def _backward(self, tensors: List[List[torch.Tensor]], grads: List[List[Any]]) -> None:
        """Runs in the outer backward when it reaches the gathered output or the
        returned loss: schedules the end-of-backward bookkeeping and, for CPU
        replicas, runs every replica's backward on its worker."""
        if self._output_in_backward:
            # The outputs of two dmodel(...) calls in one backward: each
            # replica's gradients would arrive twice in one synced backward.
            self._output_in_backward = False
            self._finish_queued = False
            self._reducer.abort("one backward ran over the outputs of two dmodel(...) calls")
            raise RuntimeError(
                "pyddp: one backward runs over the outputs of two dmodel(...) calls (e.g. "
                "(dmodel(a).sum() + dmodel(b).sum()).backward()): each replica's gradients "
                "would be produced twice in one synced backward. Concatenate the batches into "
                "one call, or backward each loss in turn (docs/troubleshooting.md)"
            )
        self._output_in_backward = True
        if not self._finish_queued:
            # The first join of this backward, before any replica accumulates:
            # after a backward over a graph kept with retain_graph=True (no
            # forward in between), the last reduction's copies are cleared as
            # a forward would (replica 0 carries the sum, the others restart).
            self._reducer.restart_accumulation()
            if self._syncbn is not None:
                self._syncbn.exchange.reset(len(tensors))
            self._finish_queued = True
            # Autograd's final callback: runs once the whole backward is done,
            # whatever else the loss depended on.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if not self._parallel_backward:
            return
        if torch.is_grad_enabled():
            raise RuntimeError(
                "pyddp: backward(create_graph=True) is not supported with CPU replicas"
            )
        # The replicas' graphs keep their saved tensors exactly when the
        # outer backward does (retain_graph=True), so a second backward
        # through the same graph works as on one device.
        retain = _keep_graph()

        def run(r: int) -> Callable[[], None]:
            def backward() -> None:
                # An output that needs no gradient on this replica (a constant
                # auxiliary loss on a shard without the case) has nothing to run.
                pairs = [
                    (t, g)
                    for t, g in zip(tensors[r], grads[r])
                    if g is not None and t.requires_grad
                ]
                if pairs:
                    torch.autograd.backward(
                        [t for t, _ in pairs], [g for _, g in pairs], retain_graph=retain
                    )

            return backward

        try:
            self._workers.run(
                [self._breaking_meetings(r, run(r)) for r in range(len(tensors))], "backward"
            )
        except ReplicaError:
            self._finish_queued = False
            self._reducer.abort()
            raise

    def _backward_began(self) -> None:
        """A gradient arrived in a backward that did not pass through this
        model's outputs (Lightning's manual_backward inside the wrapped
        forward, a loss of `.module`'s outputs, two backwards in one
        training_step): its end is queued from here, as torch DDP's reducer
        queues its own from its first gradient hook. One replica only:
        several replicas need the outputs to run their backwards."""
        if self._finish_queued:
            return
        # As _backward's first join: a previous reduction's copy is taken
        # before this backward accumulates over it.
        self._reducer.restart_accumulation()
        if self._syncbn is not None:
            self._syncbn.exchange.reset(1)
        self._finish_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._finish_queued = False
        self._output_in_backward = False
        self._reducer.finish()
        self._buffers_after_backward()


def _keep_graph() -> bool:
    """Whether the backward running now keeps its graph (retain_graph=True)."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(query()) if query is not None else False


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: use 'mean' or 'sum'")


def _checked(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        raise ValueError(
            "loss_fn must return a scalar tensor (reduce over the shard), got "
            f"{getattr(value, 'shape', type(value).__name__)}"
        )
    return value


def wrap(
    model: nn.Module, devices: Optional[Sequence[DeviceLike]] = None, **options: Any
) -> DistributedModel:
    """Replicates `model` over `devices` (duplicates allowed: several replicas on
    one device). Replica 0 is `model` itself, moved to devices[0]; the others are
    deep copies. Default devices: every GPU (else two CPU replicas); after
    `pyddp.init()`, this process's `cuda:LOCAL_RANK` (else one CPU replica).

    Across processes (torch.distributed initialised, or `group=` a process
    group): every rank must wrap the same model (checked: a ValueError names
    the first difference); rank 0's parameters and buffers are broadcast at
    wrap and its buffers after each synced training step; gradients are summed
    over this process's replicas and averaged over processes, as torch DDP.

    `options`: the fields of `pyddp.engine.options.Options`, each documented
    there (bucket_cap_mb, first_bucket_cap_mb, taper_buckets, reduce_order,
    rebuild_buckets, broadcast_buffers, threads_per_replica, timeout_s,
    timeline, group, find_unused_parameters, static_graph); an unknown or
    invalid one raises, naming itself. torch DDP's other keywords are
    accepted where they mean something here (replicas/ddp_args.py)."""
    return DistributedModel(model, devices, **options)
