"""The link's contract, and the link of a single process: there is nobody to
talk to, so every exchange returns this process's own value and every hand-off
does nothing. GradSync always holds a link (this one, or a ProcessLink across
processes) and never asks which.

Its methods serve the engine (construction, per backward) and the wrapped
model (loss weighting, buffer broadcasts). Its other callers get a face of
their own: `ranks` (control.Ranks: the optimizers, the Trainer), `joining`
(joining.Joining: torch's Join) and `statistics` (meetings.Statistics:
SyncBatchNorm)."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .control import Ranks
from .joining import Joining
from .meetings import Statistics
from .record import WorkRecord


class Reduction(NamedTuple):
    """How the engine reduces (Link.attach): the backend it launches buckets
    on, the op it asks for, and the scale every gradient needs afterwards
    (NCCL sums over every process's GPUs: 1/processes to average them)."""

    backend: Any
    op: str
    post_scale: float


class Link:
    spans_processes = False

    def __init__(self, local_count: int):
        self.rank = 0  # this process's index among the linked processes
        self.world = 1  # how many processes
        self.local_counts = [local_count]  # replicas per process, in rank order
        # The global batch's loss of the last training step's dmodel.loss, when
        # the link learns it on the host (CPU replicas across processes).
        self.global_loss: Optional[float] = None
        self.group: Any = None  # the process group spanned (torch's Join runs on it)
        self.control: Any = None  # the control exchanges (control.Control; none here)
        self.joining = Joining()  # torch's Join (nothing to exchange in one process)
        # The communication hook's name and settings (note_hook), if one is registered.
        self.hook: Tuple[Optional[str], Dict[str, str]] = (None, {})

    @property
    def statistics(self) -> Statistics:
        """SyncBatchNorm's statistics (nothing to sum in one process)."""
        return Statistics()

    @property
    def ranks(self) -> Ranks:
        """The face of the processes for the optimizers and the Trainer."""
        return Ranks(self)

    # ------------------------------------------------------- construction
    def attach(
        self,
        record: WorkRecord,
        replicas: int,
        op: str,
        gpu: Optional[Tuple[Sequence[int], Any]],
        make_local: Callable[[Optional[Callable]], Any],
    ) -> Optional[Reduction]:
        """A GradSync's one question to its link at construction: it watches
        `record` (the agreement compares it at every synced backward) and,
        unless there is nothing to reduce (one replica in one process: None),
        says how the engine reduces: through which backend (`make_local`
        builds this process's from the link's NCCL rendezvous, None on
        CPUs), with which op and what scale afterwards. `gpu`: the GPU
        replicas' (devices, stream provider), None on CPUs."""
        self.watch(record)
        if replicas == 1 and not self.spans_processes:
            return None
        post_scale, rendezvous = 1.0, None
        if gpu is not None:
            op, post_scale, rendezvous = self.gpu_reduction(op, replicas)
        backend = self.transport_backend(make_local(rendezvous), gpu is not None)
        if gpu is not None:
            self.route_through(backend, *gpu)
        return Reduction(backend, op, post_scale)

    def watch(self, record: WorkRecord) -> None:
        """Counts `record`'s optimizer steps for the agreement (across processes)."""

    def gpu_reduction(self, op: str, local: int) -> Tuple[str, float, Optional[Callable]]:
        """For GPU replicas: NCCL's op, the scale applied after it, and the
        rendezvous of a communicator over every process's GPUs (None: this
        process's GPUs alone)."""
        return op, 1.0, None

    def transport_backend(self, local: Any, on_gpu: bool) -> Any:
        """The engine's backend: `local` sums this process's replicas; across
        processes a wrapper hands each summed bucket to the other processes."""
        return local

    def route_through(self, backend: Any, devices: Sequence[int], provider: Any) -> None:
        """GPU replicas: the engine's backend (its NCCL communicator spans the
        processes), the replicas' CUDA devices and the stream provider, for
        the agreement to travel on the device after the buckets."""

    def set_scatter(self, ranks: int) -> None:
        """Sharded gradients from now on: buckets are reduce-scattered over
        `ranks` ranks (nothing rides with them)."""

    def spare_elements(self, dtype: torch.dtype) -> int:
        """The elements the link wants after replica 0's last bucket (of
        `dtype`), to send with it (the agreement, across processes)."""
        return 0

    def set_buckets(
        self,
        flats: Sequence[torch.Tensor],
        buckets: Sequence[Sequence[int]],
        params: Sequence[torch.Tensor],
        views: Sequence[Any],
        wire: Optional[torch.Tensor] = None,
    ) -> None:
        """Replica 0's flat buckets, their members, and its parameters and
        gradient views by index (after every re-layout); `wire`: its last
        bucket followed by the spare elements (None if none were asked)."""

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """A communication hook for the bucket reductions across processes.
        In one process nothing crosses a wire: said, and not used (a script
        run on one process for a test keeps working, as under torch DDP)."""
        warnings.warn(
            "pyddp: the communication hook is not used: it compresses or replaces what "
            "crosses between processes, and this model runs in one process (replicas reduce "
            "in memory)",
            stacklevel=3,
        )

    def register_gpu_hook(self, state: Any, hook: Callable[..., Any], backend: Any) -> None:
        """A Python communication hook on GPU replicas (the engine's NCCL
        `backend` calls it per bucket). In one process: said, and not used."""
        self.register_comm_hook(state, hook)

    def root_order(self, order: Sequence[int], size: int) -> Optional[List[int]]:
        """The ready order every process plans its buckets from (rank 0's)."""
        return list(order)

    # -------------------------------------------------------- per backward
    def start_agreement(
        self,
        absent: Sequence[int],
        size: int,
        record: Callable[[int], Dict[str, int]],
        shadow: bool = False,
    ) -> List[int]:
        """At the end of a synced backward, `absent` being the parameters with
        no gradient here: starts agreeing on which have one nowhere; returns
        those to reduce (with zeros from here) meanwhile (`shadow`: this rank
        joined, under torch's Join, and adds nothing). One process: none."""
        return []

    def forward_ended(self, syncing: bool) -> None:
        """A forward whose backward comes next ended (`syncing`: it reduces):
        what the link sends with the buckets can be prepared now."""

    def compare_due(self) -> None:
        """Across processes: the settings every rank must share (shard mode,
        communication hook), compared now if they changed since last time.
        A forward's end does it; GradSync's forward pre-hook too."""

    def note_hook(self, name: str, state: Dict[str, str], differ_from: Optional[int]) -> None:
        """register_comm_hook registered the hook `name` with the settings
        `state` (plan.hook_state_settings): across processes, compared before
        the next synced backward. `differ_from`: the synced backward from
        which the hook lets the ranks' parameters differ on purpose
        (plan.local_sgd_start), or None."""

    def settings_changed(self) -> None:
        """dmodel.optimizer made an optimizer (its shard mode is the work
        record's): across processes, compared before the next synced
        backward."""

    def wait(self) -> Tuple[List[int], List[int], Any]:
        """After the engine's finish: (buckets this link reduced, parameters
        with a gradient on no process, the factor every gradient still needs:
        1.0, a float, or one 0-dim tensor per replica on its device). Raises
        ProcessGroupError."""
        return [], [], 1.0

    def hook_error(self) -> Optional[BaseException]:
        """The exception a communication hook raised, if one did (the
        user's own, which finish() raises with its type)."""
        return None

    def settle(self) -> None:
        """At close: checks what the link left to check later (GPUs)."""

    def merge_timing(self, raw: Dict[str, int], timeline: Any, finish_called_ns: int) -> None:
        """Adds what the link waited for to the engine's raw statistics."""

    def check_usable(self) -> None:
        """Raises if the link failed (ProcessGroupError)."""

    def abandon(self, reason: str) -> None:
        """This rank drops the step: the other processes are told at once."""

    def abandon_unfinished(self) -> None:
        """A backward did not finish: across processes the others reduced (or
        wait to reduce) its buckets, so carrying on would pair their step with
        our next one: abandons and raises. One process: the next step starts clean."""

    # ------------------------------------------- for the model and trainer
    def weigh_losses(
        self,
        losses: List[torch.Tensor],
        rows: int,
        reduction: str,
        synced: bool,
        carried: bool,
        known: Optional[int] = None,
    ) -> List[torch.Tensor]:
        """Per-replica losses of a training step (`rows` here, `synced`: its
        backward reduces; `carried`: its buckets hold the last reduction;
        `known`: the global batch's rows, if the caller knows them) scaled so
        that averaging gradients over processes gives the global batch's
        gradient (with wait()'s factor)."""
        return losses

    def broadcast(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """Rank 0's values into `tensors` on every process."""


class GradBucket:
    """What a communication hook sees of a bucket: the methods of torch's
    `dist.GradBucket` (which Python cannot build), so torch DDP's hooks
    (default_hooks.fp16_compress_hook, bf16_compress_hook, allreduce_hook)
    and user hooks written for DDP run unchanged."""

    def __init__(self, index: int, last: bool, flat: torch.Tensor, params: list, grads: list):
        self._index, self._last, self._flat = index, last, flat
        self._params, self._grads = params, [_row_major(flat, g) for g in grads]

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._flat

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replaces the buffer, as torch's: buffer() returns `tensor` from
        now on (in its dtype: a 16-bit wrapper's hook divides and sums in 16
        bits, as under DDP); the hook's result still lands in the bucket."""
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != self._flat.numel():
            got = f"{tensor.numel()} elements" if isinstance(tensor, torch.Tensor) else tensor
            raise TypeError(
                f"GradBucket.set_buffer takes a tensor of the bucket's {self._flat.numel()} "
                f"elements, got {got!r}"
            )
        self._flat = tensor

    def gradients(self) -> List[torch.Tensor]:
        return list(self._grads)

    def parameters(self) -> List[torch.Tensor]:
        return list(self._params)


def _row_major(flat: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A gradient as torch DDP's GradBucket.gradients() gives it: its slice
    of the bucket viewed row-major, whatever the bucket view's strides (a
    channels_last one's failed hooks written for DDP that call .view on
    it, PowerSGD's `view(n, -1)`: a review)."""
    if grad.is_contiguous():
        return grad
    start = (grad.data_ptr() - flat.data_ptr()) // flat.element_size()
    return flat[start : start + grad.numel()].view(grad.shape)
