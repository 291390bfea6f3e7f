"""A wrapped model's steps on its replicas: forward (scatter the batch, run
every replica on its worker, combine the outputs on devices[0]), the loss per
replica (`dmodel.loss`, `loss_on_shards`), the backward autograd runs when it
reaches the combined outputs or loss (every CPU replica's backward on its
worker, the end of backward queued once as autograd's final callback; a
backward that bypasses the outputs queues it from its first gradient), and
the end of backward (the reducer's finish, then rank 0's buffers to every
rank, torch DDP's rule). A mixin of DistributedModel (model.py), whose state
it reads."""

from __future__ import annotations

import contextlib
import warnings
from functools import partial
from typing import (
    Any,
    Callable,
    ContextManager,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    Set,
    Tuple,
)

import torch
from torch import nn
from torch.nn.utils import parametrize as _parametrize

from .._link import Link
from ..engine.faces import ReplicaDriver
from ..errors import ReplicaError
from .combine import Combine, InputCut, combine_column, keep_graph, replica_backward
from .scatter import batch_size, call_arguments, gather_call, scatter
from .staged import StagedBuffers
from .syncbn import SyncBatchNorms
from .workers import ReplicaWorkers

# The remedy where a replica's backward must stay in the graph torch walks.
_ONE_PER_PROCESS = (
    "run one replica per process under torchrun instead (pyddp.wrap(model) in each), where "
    "create_graph=True works as under torch DDP (a gradient penalty: docs/semantics.md)"
)


def release(workers: Any, reducer: Any, syncbn: Any, wait: bool = True) -> None:
    """A wrapped model's close(), and its end when it is collected (wait
    False: on no thread nor the link): threads, hooks, SyncBatchNorm's binding."""
    workers.close(wait)
    reducer.close(wait)
    if syncbn is not None:
        syncbn.release()  # torch's SyncBatchNorm again


_CACHED_PARAMETRIZATIONS = (
    "pyddp: torch.nn.utils.parametrize.cached() around a forward of several replicas in one "
    "process: torch caches a parametrized weight by the module it was registered on, which "
    "the replicas' copies share, so every replica would get replica 0's weight (and its "
    "graph); leave cached() out of the wrapped forward, or run one replica per process"
)


class StepFlags:
    """The running step's flags, on a plain object: they change at every forward and
    backward, and an nn.Module's own attribute costs a microsecond to set."""

    __slots__ = ("finish_queued", "output_in_backward", "buffers_due", "send_at_next")

    def __init__(self) -> None:
        self.finish_queued = False  # this backward's end is queued (_end_of_backward)
        self.output_in_backward = False  # the running backward went through a dmodel output
        self.buffers_due = False  # rank 0's buffers to every rank after this backward
        self.send_at_next = False  # a synced training forward no backward answered (_begin)


class StepsHost(Protocol):
    """What ReplicaSteps reads of the DistributedModel it is mixed into
    (model.py, and uneven.py for Join) and does not define itself."""

    module: nn.Module  # the user's model: replica 0
    devices: List[torch.device]
    broadcast_buffers: bool
    _replicas: List[nn.Module]
    _callables: List[Callable[..., Any]]  # the replicas, compiled by dmodel.compile()
    _reducer: ReplicaDriver
    _link: Link
    _workers: ReplicaWorkers
    _syncbn: Optional[SyncBatchNorms]
    _passthrough: bool  # one replica, one process: nothing to scatter or reduce
    _parallel_backward: bool  # CPU replicas' backward on their workers
    _gpus: Optional[List[int]]  # CUDA device per replica (None: CPUs)
    _streams: Any  # their stream provider (engine/streams.py; None: CPUs)
    _apart_after_join: str  # why training is refused after Join ("" if not)
    _join_config: Any  # torch's Join's, for this model (enable: under Join)
    _flags: StepFlags
    _staged: StagedBuffers
    _params_moved: Callable[[], Set[int]]  # ids of replica 0's given new storage since the forward

    def _check_open(self) -> None: ...
    def _follow_model(self) -> None: ...
    def _copy_buffers(self) -> None: ...
    def _broadcast_buffers_now(self, now: bool = False) -> None: ...
    def _notify_join(self) -> None: ...
    def _join_forward(self, rows: int) -> None: ...


class ReplicaSteps:
    def loss(
        self,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        inputs: Any,
        targets: Any,
        *,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """`loss_fn(replica(shard inputs), shard targets)` on each replica's own device, summed
        on devices[0] without gathering outputs. "mean" (loss_fn averages): shards weighted by
        their rows (an empty one's NaN by 0), so uneven shards give the full-batch mean; "sum":
        added. `inputs`: the model's argument, a tuple of positional arguments, or a dict of
        keyword arguments (a dict argument goes in a 1-tuple: `(d,)`)."""
        self._check_open()
        args, kwargs = call_arguments(inputs)  # checked here, not on every replica
        if self._passthrough:
            _check_reduction(reduction)
            return _checked(loss_fn(self._callables[0](*args, **kwargs), targets))
        with self._abandon_on_error("forward/loss"):
            shards, _, cut = scatter((inputs, targets), self.devices, self._cuts_inputs())
        return self._loss_on_shards(loss_fn, shards, reduction, None, cut, None)

    def loss_on_shards(
        self,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        shards: Sequence[Tuple[Tuple[Any, ...], Any]],
        *,
        reduction: str = "mean",
        context: Optional[Callable[[], ContextManager[Any]]] = None,
        global_rows: Optional[int] = None,
    ) -> torch.Tensor:
        """Like `loss`, for batches already split and placed on the replicas'
        devices (per-device data loading): shards[r] = (inputs, targets) for
        replica r, inputs as in `loss`; fewer shards than replicas leaves the rest
        out. `context`, if given, is entered on each replica's thread around its
        forward and loss (e.g. autocast, which is thread-local). `global_rows`:
        the rows of the batch over every process, if the caller knows them
        (across processes they are then neither exchanged nor assumed)."""
        return self._loss_on_shards(loss_fn, shards, reduction, context, None, global_rows)

    def _loss_on_shards(
        self,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        shards: Sequence[Tuple[Tuple[Any, ...], Any]],
        reduction: str,
        context: Optional[Callable[[], ContextManager[Any]]],
        cut: Optional[InputCut],
        global_rows: Optional[int],
    ) -> torch.Tensor:
        self._check_open()
        _check_reduction(reduction)
        if not 1 <= len(shards) <= len(self._replicas):
            raise ValueError(f"got {len(shards)} shards for {len(self._replicas)} replicas")
        sizes = [batch_size(args) for args, _ in shards]
        total = sum(sizes)  # (0: an empty batch's one shard, its loss as is, as on one device)
        self._notify_join()
        self._begin(total)

        def replica_loss(r: int) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:
                shard_inputs, shard_targets = shards[r]
                args, kwargs = call_arguments(shard_inputs)
                with context() if context is not None else contextlib.nullcontext():
                    out = self._callables[r](*args, **kwargs)
                    value = _checked(loss_fn(out, shard_targets))
                if reduction == "mean" and total:  # (an empty shard's mean, NaN, weighs 0)
                    value = (value if sizes[r] else torch.nan_to_num(value)) * (sizes[r] / total)
                return value

            return run

        with self._abandon_on_error("forward/loss"), self._sync_batchnorm(len(shards)):
            runs = [self._breaking_meetings(r, replica_loss(r)) for r in range(len(shards))]
            losses = self._workers.run(runs, "forward/loss", sizes)
        # Training steps only: an evaluation (eval mode) may run on some ranks alone.
        if self.training and torch.is_grad_enabled():
            reducer = self._reducer
            losses = self._link.weigh_losses(
                losses, total, reduction, reducer.syncing, reducer.carried, global_rows
            )
        if torch.is_grad_enabled():
            self._reducer.note_forward_end()
        if self._passthrough or not any(v.requires_grad for v in losses):
            return combine_column(losses, "sum", self.devices[0], [])
        return self._combine([[v] for v in losses], ["sum"], [], cut)[0]

    @contextlib.contextmanager
    def _abandon_on_error(self, what: str) -> Iterator[None]:
        """Across processes, a training forward that raises here leaves the
        other ranks waiting for this rank's step: they are told at once (and
        this wrapper refuses further steps) instead of pairing our next step
        with theirs."""
        try:
            yield
        except BaseException as e:
            if self._link.spans_processes and torch.is_grad_enabled():
                self._reducer.abort(f"its {what} raised {type(e).__name__}: {e}")
            raise

    def _combine(
        self,
        tensors: List[List[torch.Tensor]],
        kinds: List[str],
        weights: Any,
        cut: Optional[InputCut] = None,
    ) -> List[torch.Tensor]:
        """Combines per-replica tensors on devices[0] through autograd: backward
        through the result runs every replica's backward (_backward), and
        returns the gradients of the input shards `cut` to them."""
        node = Combine(
            tensors, kinds, self.devices[0], weights, self._backward, self._parallel_backward, cut
        )
        return list(node.apply())

    def _gathered(self, outs: List[Any], sizes: List[int], cut: Any, call: Any, shards: Any) -> Any:
        """The outputs of a forward `call` (args, kwargs) over `shards` on devices[0]
        (scatter.gather_call); its input shards `cut` (InputCut) held by the combining node."""
        combine = partial(self._combine, cut=cut)
        return gather_call(call, shards, outs, sizes, self.devices[0], combine, self)

    def _cuts_inputs(self) -> bool:
        """Where each CPU replica's backward runs over its own graph (on its
        worker), inputs that need a gradient are cut (combine.InputCut)."""
        return self._parallel_backward and torch.is_grad_enabled()

    def _start(self, tree: Any) -> Tuple[List[Any], List[int], Optional[InputCut]]:
        """Scatters `tree` and readies the replicas for a new iteration."""
        if _parametrize._cache_enabled and any(
            map(_parametrize.is_parametrized, self.module.modules())
        ):
            raise RuntimeError(_CACHED_PARAMETRIZATIONS)
        shards, sizes, cut = scatter(tree, self.devices, self._cuts_inputs(), call=True)
        self._begin(sum(sizes))
        return shards, sizes, cut

    def _begin(self, rows: int) -> None:
        """Readies the replicas for a forward of `rows` rows (a backward may follow)."""
        if self._passthrough:
            return
        if self.training != self.module.training:
            self.training = self.module.training
        grad = torch.is_grad_enabled()  # (read once: this runs before every forward)
        if grad:
            if self._apart_after_join:
                raise RuntimeError(self._apart_after_join)  # on every rank alike
            self._flags.finish_queued = False  # a backward that raised never ran its callback
            self._flags.output_in_backward = False
            self._reducer.prepare_all()
        self._follow_model()
        self._workers.before_forward()  # (transformers' gradient checkpointing: in turn)
        # The forward after a synced training one no backward answered (two
        # views before one backward, forwards alone): rank 0's buffers now, as
        # DDP (outside Join). Evaluation forwards (eval mode or no grad) do not
        # count: after an answered step rank 0 may evaluate alone.
        training = grad and self.training
        send = self._flags.send_at_next and not self._join_config.enable
        self._flags.buffers_due = grad and (  # DDP's: synced, with grad, eval mode too
            self.broadcast_buffers and self._link.spans_processes and self._reducer.syncing
        )
        if training or send:
            self._flags.send_at_next = training and self._flags.buffers_due
        self._join_forward(rows)  # under Join: what the joined ranks shadow
        # Training forwards (DDP's default) and eval forwards alike: replicas > 0
        # updated their own BatchNorm statistics in their last training forward.
        self._broadcast_buffers_now(send)

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
        meeting = self._syncbn.meeting

        def run() -> Any:
            try:
                return fn()
            except BaseException as e:
                meeting.abort(f"replica {r} raised {type(e).__name__}: {e}")
                raise

        return run

    def _backward(
        self,
        tensors: List[List[torch.Tensor]],
        grads: List[List[Any]],
        cut: Optional[InputCut],
        call: str,
    ) -> None:
        """Runs in the outer backward when it reaches the gathered output or the
        returned loss: schedules the end-of-backward bookkeeping and, for CPU
        replicas, runs every replica's backward on its worker. Under
        autograd.grad(out, inputs) or backward(inputs=...) (`call`, see
        combine.backward_call): nothing is reduced, and CPU replicas compute
        only the gradients of the inputs `cut` (autograd walks GPU replicas'
        graphs itself)."""
        if call != "backward":
            if self._parallel_backward and cut is not None:
                self._input_gradients(tensors, grads, cut)
            return
        if self._flags.output_in_backward:
            # The outputs of two dmodel(...) calls in one backward: each
            # replica's gradients would arrive twice in one synced backward.
            self._flags.output_in_backward = False
            self._flags.finish_queued = False
            self._reducer.abort("one backward ran over the outputs of two dmodel(...) calls")
            raise RuntimeError(
                "pyddp: one backward runs over the outputs of two dmodel(...) calls (e.g. "
                "(dmodel(a).sum() + dmodel(b).sum()).backward()): each replica's gradients "
                "would be produced twice in one synced backward. Concatenate the batches into "
                "one call, or backward each loss in turn (docs/troubleshooting.md)"
            )
        self._flags.output_in_backward = True
        if not self._flags.finish_queued:
            # The first join of this backward, before any replica accumulates:
            # after a backward over a graph kept with retain_graph=True (no
            # forward in between), the last reduction's copies are cleared as
            # a forward would (replica 0 carries the sum, the others restart).
            self._reducer.restart_accumulation(self._params_moved)
            if self._syncbn is not None:
                self._syncbn.meeting.reset(len(tensors))
            self._flags.finish_queued = True
            # Autograd's final callback: runs once the whole backward is done,
            # whatever else the loss depended on.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if not self._parallel_backward:
            return
        if torch.is_grad_enabled():
            raise RuntimeError(
                "pyddp: backward(create_graph=True) is not supported with CPU replicas in one "
                f"process; {_ONE_PER_PROCESS}"
            )
        # The replicas' graphs keep their saved tensors exactly when the
        # outer backward does (retain_graph=True), so a second backward
        # through the same graph works as on one device.
        retain = keep_graph()

        def run(r: int) -> Callable[[], None]:
            return partial(replica_backward, tensors[r], grads[r], retain)

        try:
            self.replica_backwards([run(r) for r in range(len(tensors))])
        except ReplicaError:
            self._flags.finish_queued = False
            self._reducer.abort()
            raise

    def replica_backwards(self, runs: List[Callable[[], None]]) -> None:
        """runs[r]: replica r's backward, on its worker (on simulated GPUs,
        host tensors, as autograd runs GPU replicas': autograd_backward)."""
        n = len(runs)  # a batch of fewer shards: replicas 0..n-1
        if self._streams is not None:
            self._streams.autograd_backward(self._gpus[:n], self._replicas[:n], runs)
            return
        self._workers.run([self._breaking_meetings(r, runs[r]) for r in range(n)], "backward")

    def _input_gradients(
        self, tensors: List[List[torch.Tensor]], grads: List[List[Any]], cut: InputCut
    ) -> None:
        """The inputs' gradients alone, each replica's into its leaves."""
        if torch.is_grad_enabled():
            raise RuntimeError("pyddp: create_graph=True (autograd.grad or backward(inputs=...)) "
                               f"is not supported with CPU replicas in one process; "
                               f"{_ONE_PER_PROCESS}")  # fmt: skip
        # (torch does not tell autograd.grad, which says itself that a parameter
        # was not used, from backward(inputs=...), which would leave it None.)
        warnings.warn(
            "pyddp: autograd.grad or backward(inputs=...) through a wrapped model's output "
            "computes, with CPU replicas, the gradients of its inputs only: the wrapped "
            "model's own parameters get none, even if asked for (use backward() for them)",
            stacklevel=4,
        )
        if self._syncbn is not None:
            self._syncbn.meeting.reset(len(tensors))
        retain, n = keep_graph(), len(tensors)
        self.replica_backwards(
            [partial(replica_backward, tensors[r], grads[r], retain, cut.of(r, n))
             for r in range(n)]
        )  # fmt: skip

    def _backward_began(self) -> None:
        """A gradient arrived in a backward that did not pass through this
        model's outputs (Lightning's manual_backward inside the wrapped
        forward, a loss of `.module`'s outputs, two backwards in one
        training_step): its end is queued from here, as torch DDP's reducer
        queues its own from its first gradient hook. One replica only:
        several replicas need the outputs to run their backwards."""
        if self._flags.finish_queued:
            return
        # As _backward's first join: a previous reduction's copy is taken
        # before this backward accumulates over it.
        self._reducer.restart_accumulation(self._params_moved)
        if self._syncbn is not None:
            self._syncbn.meeting.reset(1)
        self._flags.finish_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._flags.finish_queued = False
        self._flags.output_in_backward = False
        self._reducer.finish()
        self._buffers_after_backward()

    def _buffers_after_backward(self) -> None:
        """torch DDP's buffer rule, across processes: after a synced training
        forward (grad enabled, not under no_sync()), rank 0's buffers (the
        highest rank with inputs under Join) go to every rank. DDP sends
        them before the next forward, whatever its mode; pyddp sends the
        same values at the end of that forward's backward, and puts them in
        at the next forward (staged.py), so that forward needs no collective
        (an evaluation may still run on some ranks only)."""
        self._flags.send_at_next = False  # answered
        if self._flags.buffers_due:
            self._flags.buffers_due = False
            self._staged.receive(self._link, self.module)  # (under Join: the highest with inputs)


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
