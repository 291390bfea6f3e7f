"""The link's contract, and the link of a single process: there is nobody to
talk to, so every exchange returns this process's own value and every hand-off
does nothing. GradSync always holds a link (this one, or a ProcessLink across
processes) and never asks which."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

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
        self.divide_by_active = False  # under Join (across processes only)
        self.join: Any = None  # under Join, this forward's step (across processes only)

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
        self, losses: List[torch.Tensor], rows: int, reduction: str, synced: bool
    ) -> List[torch.Tensor]:
        """Per-replica losses of a training step (`rows` here, `synced`: its
        backward reduces) scaled so that averaging gradients over processes
        gives the global batch's gradient (with wait()'s factor)."""
        return losses

    def broadcast(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """Rank 0's values into `tensors` on every process."""

    def global_ranks(self) -> List[int]:
        """Each process's global rank (torch.distributed's), in rank order."""
        return [0]

    def sum_over_ranks(self, values: Sequence[float], what: str) -> List[float]:
        """Element-wise sums over processes (`what` names the exchange)."""
        return [float(v) for v in values]

    def hook_error(self) -> Optional[BaseException]:
        """The exception a communication hook raised, if one did (the
        user's own, which finish() raises with its type)."""
        return None

    def name_failure(self, what: str, error: BaseException) -> None:
        """`error` from a collective of someone else's on the group (torch's
        Join's): raised again, across processes named after `what` with the
        ranks that died or stopped (the link then fails for good)."""
        raise error

    def gather_tensor(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Every process's `t` (a CPU tensor of the same size and dtype on
        every rank), end to end in rank order, bit for bit."""
        return t

    def from_root(self, obj: Any, what: str, root: int = 0) -> Any:
        """Rank `root`'s `obj` on every process (rank 0 unless said)."""
        return obj

    def gather_objects(self, obj: Any, what: str) -> List[Any]:
        """Every process's `obj`, in rank order."""
        return [obj]

    def join_step(self, has_inputs: bool, broadcasts: bool, syncs: bool, rows: float) -> Any:
        """Under torch's Join: what this forward does on the ranks with
        inputs (joining.JoinStep). One process: nothing to exchange."""
        return None

    def enter_join(self, divide_by_active: bool) -> None:
        """torch's Join hands out its hook: gradients are then averaged over
        the ranks with inputs (`divide_by_active`, torch DDP's
        divide_by_initial_world_size=False) or over every rank."""
        self.divide_by_active = divide_by_active

    def leave_join(self) -> None:
        """After torch's Join, however it ended: nothing of it is left."""
        self.divide_by_active = False

    def end_join(self, last: bool, state: Sequence[torch.Tensor]) -> int:
        """After torch's Join: every rank takes the last joiner's `state`;
        returns that rank. One process: this one."""
        return 0

    def stats_backend(self, devices: Sequence[int], timeout: Optional[float]) -> Any:
        """For SyncBatchNorm on GPUs: a backend whose collectives span every
        GPU of every process, apart from the buckets' (one process: the same
        communicators, whose launches each cover every GPU of the process
        under one lock, so any interleaving pairs)."""
        from ..runtime.libraries import make_backend

        return make_backend(list(devices), timeout, self.stats_rendezvous())

    def stats_rendezvous(self) -> Optional[Callable[[str], tuple]]:
        """The NCCL rendezvous of stats_backend (None: this process's GPUs)."""
        return None

    def stats_summer(self) -> Optional[Callable[[torch.Tensor, str], None]]:
        """For SyncBatchNorm: a function that sums a CPU tensor over the
        processes in place, given "forward" or "backward" (None: one
        process, nothing to sum)."""
        return None
