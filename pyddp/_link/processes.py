"""The link across processes, on torch.distributed: composes the rendezvous
(groups.py), the control exchanges (control.py), the per-backward agreement
(agreement.py), the bucket transport (transport.py) and the failure handling
(failure.py) behind the contract in link.py."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _C
from ..errors import ProcessGroupError
from .agreement import Agreement
from .control import LOSS_WEIGHTS, PARAMS_BROADCAST, Control
from .failure import Failure
from .groups import Peers
from .link import Link
from .record import WorkRecord, watch_steps
from .transport import BucketTransport


class ProcessLink(Link):
    spans_processes = True

    def __init__(self, peers: Peers, names: Sequence[str]):
        self.peers = peers
        self.failure = Failure(peers)
        self.transport = BucketTransport(peers, self.failure, names)
        self.control = Control(peers, self.failure)
        self.agreement = Agreement(self.control)
        self.rank, self.world = peers.rank, peers.world
        self.local_counts: List[int] = []

    @property
    def prefix(self) -> str:
        """This link's key space in torch.distributed's store."""
        return self.peers.prefix

    # ------------------------------------------------------- construction
    def adopt_root_model(
        self, replicas: Sequence[Any], device_type: str, op: str, settings: Dict[str, Any]
    ) -> None:
        """At construction: the same model and settings on every rank (else a
        ValueError naming the first difference), then rank 0's parameters and
        buffers on every replica of every rank, as torch DDP does."""
        m0 = replicas[0]
        entries = [("parameter", n, p) for n, p in m0.named_parameters()]
        entries += [("buffer", n, b) for n, b in m0.named_buffers()]
        signature = [("setting", f"{k}={v!r}") for k, v in settings.items()]
        signature += model_signature(entries, device_type)
        self.control.check_same(signature, "model")
        self.local_counts = self.control.counts(len(replicas))
        if op == "avg" and len(set(self.local_counts)) != 1:
            raise ValueError(
                f"op='avg' across processes with {self.local_counts} replicas per process: "
                "use the same number of replicas in every process, or op='sum'"
            )
        state = [t for _, _, t in entries]
        self.control.broadcast(state, PARAMS_BROADCAST)
        with torch.no_grad():
            for m in replicas[1:]:
                mine = [p for p in m.parameters()] + [b for b in m.buffers()]
                for dst, src in zip(mine, state):
                    dst.copy_(src)

    def watch(self, record: WorkRecord) -> None:
        watch_steps(record)

    def gpu_reduction(self, op: str, local: int) -> Tuple[str, float, Optional[Callable]]:
        return (*nccl_op(op, self.local_counts), self._nccl_rendezvous())

    def _nccl_rendezvous(self) -> Callable[[str], tuple]:
        """For make_backend: one NCCL communicator over every process's GPUs.
        Rank 0's unique id travels through torch.distributed's store; this
        process's GPUs are ranks first.. of the total."""
        first, total = sum(self.local_counts[: self.rank]), sum(self.local_counts)
        store, key = self.peers.store, f"{self.peers.prefix}/nccl_id"

        def rendezvous(nccl_path: str) -> tuple:
            if store is None:
                raise RuntimeError("NCCL across processes needs torch.distributed's store")
            if self.rank == 0:
                store.set(key, _C.nccl_unique_id(nccl_path))
            return bytes(store.get(key)), total, first

        return rendezvous

    def transport_backend(self, local: Any, on_gpu: bool) -> Any:
        if on_gpu:
            return local  # NCCL's communicator spans the processes itself
        # This process's replicas sum in C++, then the launcher hands each
        # bucket to the transport (launch holds no reference to the link).
        return _C.ProcessGroupBackend(local, self.transport.launch, f"{local.name}+gloo")

    def set_buckets(self, flats: Sequence[torch.Tensor], buckets: Sequence[Sequence[int]]) -> None:
        self.transport.flats = list(flats)
        self.transport.buckets = [list(b) for b in buckets]

    def root_order(self, order: Sequence[int], size: int) -> Optional[List[int]]:
        return self.control.root_order(order, size)

    # -------------------------------------------------------- per backward
    def start_agreement(
        self, absent: Sequence[int], size: int, record: Callable[[int], Dict[str, int]]
    ) -> List[int]:
        # Every rank must launch the same buckets: a parameter without a
        # gradient here is reduced too, with zeros from here; which of them
        # have a gradient on no process at all is agreed meanwhile.
        self.agreement.start(absent, size, record(self.peers.iteration))
        return list(absent)

    def wait(self) -> Tuple[List[int], List[int]]:
        return self.transport.wait(), self.agreement.unused_everywhere()

    def merge_timing(self, raw: Dict[str, int], timeline: Any, finish_called_ns: int) -> None:
        # The engine saw its launches return; the reductions ended when
        # torch.distributed's futures completed, after finish() waited.
        done, transport = self.transport.done_ns_last, self.transport
        if done:
            raw["last_done_ns"] = max(raw["last_done_ns"], max(done.values()))
            if timeline is not None:
                for b, t in done.items():
                    timeline["bucket_done_ns"][b] = t
        # The engine's clock is the steady clock: time.monotonic_ns here.
        raw["finish_start_ns"] = min(raw["finish_start_ns"], finish_called_ns)
        raw["wait_ns"] += transport.wait_ns
        raw["finish_end_ns"] += transport.wait_ns
        raw["agree_ns"] = self.agreement.exposed_ns

    def check_usable(self) -> None:
        self.failure.check()

    def abandon(self, reason: str) -> None:
        self.failure.abandon(reason)

    def abandon_unfinished(self) -> None:
        self.failure.abandon("a backward did not finish (it raised?)")
        raise ProcessGroupError(self.failure.failed)

    # ------------------------------------------- for the model and trainer
    def weigh_losses(
        self, losses: List[torch.Tensor], rows: int, reduction: str
    ) -> Tuple[List[torch.Tensor], Optional[float]]:
        """Gradients are averaged over processes. "mean": this rank's are
        scaled by world * rows here / rows everywhere, so an uneven global
        batch stays exact; one small exchange, which on CPU replicas also
        gives the global batch's loss (None on GPUs, where reading the loss
        would make the host wait). "sum" (over the global batch): the
        average over processes is undone."""
        if reduction != "mean":
            return [_ScaleGrad.apply(v, float(self.world)) for v in losses], None
        on_host = all(v.device.type == "cpu" for v in losses)
        local = sum(float(v.detach()) for v in losses) if on_host else 0.0
        rows_all, loss_sum = self.sum_over_ranks([float(rows), local * rows], LOSS_WEIGHTS)
        scale = self.world * rows / rows_all
        return [_ScaleGrad.apply(v, scale) for v in losses], (
            loss_sum / rows_all if on_host else None
        )

    def broadcast(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        self.control.broadcast(tensors, what)

    def sum_over_ranks(self, values: Sequence[float], what: str) -> List[float]:
        return self.control.sum_over_ranks(values, what)

    def from_root(self, obj: Any, what: str) -> Any:
        return self.control.from_root(obj, what)

    def gather_objects(self, obj: Any, what: str) -> List[Any]:
        return self.control.gather_objects(obj, what)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def model_signature(entries: Sequence[tuple], device_type: str) -> List[tuple]:
    """What must match across ranks: every parameter's and buffer's name,
    shape and dtype, and the kind of device."""
    sig: List[tuple] = [("device type", device_type)]
    for kind, name, t in entries:
        sig.append((kind, name, tuple(t.shape), str(t.dtype).replace("torch.", "")))
    return sig


def nccl_op(op: str, counts: Sequence[int]) -> Tuple[str, float]:
    """NCCL's op and the scale after it, so that gradients are summed (op
    "sum") or averaged ("avg") over a process's replicas and averaged over
    processes. One GPU per process: NCCL's average is exactly that."""
    world = len(counts)
    if all(c == 1 for c in counts):
        return "avg", 1.0
    if op == "sum":
        return "sum", 1.0 / world
    if len(set(counts)) != 1:
        raise ValueError(
            f"op='avg' across processes with {counts} GPUs per process: use the same number "
            "of GPUs in every process, or op='sum'"
        )
    return "avg", 1.0
