"""Collectives over a list of per-replica tensors in one process: all_reduce
and broadcast in place, all_gather and reduce_scatter into new tensors. CPU
tensors in process, one tensor per GPU through NCCL, several on one GPU
through pyddp's kernels. CuPy arrays (anything with
``__cuda_array_interface__``) are accepted and modified in place, ordered
against CuPy's current stream. Backends share the process-wide communicators
of their devices with every wrapped model (one launch lock per device set)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from .._link import resolve_group
from .._link.transport import all_reduce_blocking
from ..errors import ReduceError
from ..runtime.libraries import DTYPE_NAMES, backend_kind, make_backend
from .streams import gpu_placement

# (kind, devices) -> (backend, lock). A backend is not re-entrant: one call at
# a time; a backend that failed is dropped so the next call builds a fresh one.
_backends: Dict[Tuple[str, Tuple[int, ...]], Tuple[Any, threading.Lock]] = {}
_backends_lock = threading.Lock()


def all_reduce(
    tensors: Sequence[Any],
    op: str = "sum",
    group: Any = None,
) -> None:
    """Reduces `tensors` (one per replica; same shape and dtype; dense,
    contiguous and sharing no memory with each other) in place: afterwards
    each holds the sum (op="sum") or the mean (op="avg") of all.
    float16/bfloat16 accumulate in float32 on the CPU and on one GPU (NCCL
    rounds at each hop). On GPUs the reduction is ordered after the work queued
    on each device's current stream (CuPy's current stream for CuPy arrays),
    and those streams wait for it; the host does not block. A tensor allocated
    on another stream is recorded on the current one, so its memory is not
    reused before the reduction is done. One tensor: nothing to reduce, no
    communicator is created.

    Across processes (torch.distributed initialised with several processes,
    or `group=` a process group; every rank must call it): the tensors of
    every process are reduced, "avg" dividing by their total count. CPU
    tensors only for now; this blocks until done."""
    cupy_streams, tensors = _prepared("all_reduce", tensors)
    if op not in ("sum", "avg"):
        raise ValueError(f"all_reduce: op={op!r}, use 'sum' or 'avg'")
    xgroup = resolve_group(group)
    if xgroup is not None:
        _all_reduce_across(tensors, cupy_streams, op, xgroup)
    else:
        _reduce_in_process(tensors, cupy_streams, op)
    # Written in place behind torch's back: autograd must know (a tensor saved
    # for backward and reduced since raises, as after torch's own add_).
    if len(tensors) > 1 or xgroup is not None:  # (one, alone: nothing written)
        torch.autograd.graph.increment_version(tensors)


def _reduce_in_process(
    tensors: Sequence[torch.Tensor],
    cupy_streams: Sequence[Any],
    op: str,
) -> None:
    """The reduction over this process's tensors (already checked)."""
    if len(tensors) == 1:
        return  # the sum and the mean of one tensor is itself
    first = tensors[0]
    place = _Place("all_reduce", tensors, cupy_streams)
    place.run(
        tensors,
        lambda b: b.reduce(
            _ptrs(tensors), place.devices, place.streams, first.numel(), _name(first), op
        ),
    )


class _Place:
    """Where a one-process collective runs: the backend of `tensors`'
    devices (one per replica; shared with every other caller on them),
    ordered on each device's current stream through the stream provider
    GradSync uses (torch's; the simulation's in the test suite), or on
    CuPy's current stream for CuPy arrays."""

    def __init__(self, what: str, tensors: Sequence[torch.Tensor], cupy_streams: Sequence[Any]):
        gpu = gpu_placement([t.device for t in tensors], what)
        if gpu is not None:
            indices, self.provider = tuple(gpu[0]), gpu[1]
            places: List[Any] = list(indices)
        else:
            places = [t.device for t in tensors]
            indices, self.provider = (-1,) * len(places), None
        self.key = (backend_kind(places), indices)
        with _backends_lock:
            if self.key not in _backends:
                _backends[self.key] = (make_backend(places), threading.Lock())
            self.backend, self.lock = _backends[self.key]
        self.devices = list(indices)
        self.cupy_streams = list(cupy_streams)
        self.streams = [
            0 if self.provider is None else (cs if cs is not None else self.provider.current(i))
            for i, cs in zip(indices, cupy_streams)
        ]
        self.places = [t.device for t in tensors]

    def empty(self, shape: Tuple[int, ...], dtype: torch.dtype, replica: int) -> torch.Tensor:
        """An output of `shape` on replica's device (from the stream
        provider on GPUs: their current stream's memory)."""
        if self.provider is None:
            return torch.empty(shape, dtype=dtype, device=self.places[replica])
        count = 1
        for d in shape:
            count *= d
        return self.provider.zeros(count, dtype, self.devices[replica]).view(shape)

    def queued_after(self) -> None:
        """The torch ops that follow read the collective's result (queued
        on the current streams with torch; the simulation drains them)."""
        if self.provider is not None:
            for d in set(self.devices):
                self.provider.before_host_write(d)

    def run(self, touched: Sequence[torch.Tensor], call: Callable[[Any], None]) -> None:
        """`call(backend)` under the backend's lock; `touched`: every tensor
        it reads or writes, in groups of one per replica."""
        n = len(self.devices)
        with self.lock:
            try:
                _record_streams(touched, self.cupy_streams * (len(touched) // n))
                call(self.backend)
            except ReduceError:
                with _backends_lock:
                    _backends.pop(self.key, None)
                raise


def broadcast(tensors: Sequence[Any], root: int = 0) -> None:
    """Copies tensors[root] into every other tensor of `tensors` (one per
    replica, as all_reduce takes them), in place, bit for bit; on GPUs
    ordered on the current streams like all_reduce. One process only."""
    cupy_streams, tensors = _checked("broadcast", tensors)
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < len(tensors):
        raise ValueError(f"broadcast: root={root!r} is not an index of the {len(tensors)} tensors")
    if len(tensors) == 1:
        return
    first = tensors[0]
    place = _Place("broadcast", tensors, cupy_streams)
    # The backend's root is a rank: NCCL numbers the GPUs by device.
    rank = place.backend.rank_of(root)
    place.run(
        tensors,
        lambda b: b.broadcast(
            _ptrs(tensors), place.devices, place.streams, first.numel(), _name(first), rank
        ),
    )
    torch.autograd.graph.increment_version([t for i, t in enumerate(tensors) if i != root])


def all_gather(tensors: Sequence[Any]) -> List[torch.Tensor]:
    """Every replica's tensor on every replica: returns, for each entry of
    `tensors` (one per replica), a new tensor of shape (len(tensors),
    *shape) on its device whose [k] is tensors[k], bit for bit. On GPUs
    ordered on the current streams like all_reduce. One process only."""
    cupy_streams, tensors = _checked("all_gather", tensors)
    n, first = len(tensors), tensors[0]
    if n == 1:
        return [first.detach().clone().unsqueeze(0)]
    place = _Place("all_gather", tensors, cupy_streams)
    # Blocks come in rank order (NCCL numbers the GPUs by device): an
    # output's block for rank k is tensors[r]'s where rank_of(r) == k.
    rank = [place.backend.rank_of(r) for r in range(n)]
    gathered = [place.empty((n, *first.shape), first.dtype, r) for r in range(n)]
    place.run(
        list(tensors) + gathered,
        lambda b: b.all_gather(
            _ptrs(tensors), _ptrs(gathered), place.devices, place.streams, first.numel(),
            _name(first),
        ),
    )  # fmt: skip
    if rank == list(range(n)):
        return gathered
    place.queued_after()
    return [g[torch.tensor(rank, device=g.device)] for g in gathered]


def reduce_scatter(tensors: Sequence[Any], op: str = "sum") -> List[torch.Tensor]:
    """The reduction of `tensors` (one per replica, as all_reduce takes
    them), scattered: their first dimension is cut into len(tensors) equal
    blocks, and replica r gets block r of the sum (op="sum") or mean
    ("avg") as a new tensor on its device: block r of all_reduce's result,
    bit for bit on the CPU and on one GPU. On GPUs ordered on the current
    streams like all_reduce. One process only."""
    cupy_streams, tensors = _checked("reduce_scatter", tensors)
    if op not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter: op={op!r}, use 'sum' or 'avg'")
    n, first = len(tensors), tensors[0]
    if first.dim() == 0 or first.shape[0] % n:
        raise ValueError(
            f"reduce_scatter: tensors are {tuple(first.shape)}; their first dimension must be "
            f"a multiple of the {n} replicas"
        )
    shape = (first.shape[0] // n, *first.shape[1:])
    if n == 1:
        return [first.detach().clone()]
    place = _Place("reduce_scatter", tensors, cupy_streams)
    rank = [place.backend.rank_of(r) for r in range(n)]
    if rank != list(range(n)):
        raise NotImplementedError(
            "reduce_scatter: the GPUs must be given in increasing order (NCCL gives each rank "
            f"its block, and ranks follow the device numbers: {place.devices})"
        )
    outs = [place.empty(shape, first.dtype, r) for r in range(n)]
    place.run(
        list(tensors) + outs,
        lambda b: b.reduce_scatter(
            _ptrs(tensors), _ptrs(outs), place.devices, place.streams, outs[0].numel(),
            _name(first), op,
        ),
    )  # fmt: skip
    return outs


def _name(t: torch.Tensor) -> str:
    return DTYPE_NAMES[t.dtype]


def _checked(what: str, tensors: Sequence[Any]) -> Tuple[List[Any], List[torch.Tensor]]:
    """The CuPy streams and tensors of a one-process collective, checked as
    all_reduce checks them; across processes refused by name."""
    cupy_streams, checked = _prepared(what, tensors)
    if resolve_group(None) is not None:
        raise NotImplementedError(
            f"pyddp.{what} runs over one process's tensors; across processes use "
            f"torch.distributed's {what}"
        )
    return cupy_streams, checked


def _prepared(what: str, tensors: Any) -> Tuple[List[Any], List[torch.Tensor]]:
    """Every collective's arguments: `tensors` (one per replica, checked by
    _check_tensors) and their CuPy streams. One tensor (or CUDA array) is
    refused: torch.distributed's spelling (`all_reduce(t)`) would otherwise
    iterate over its rows and reduce them as if they were replicas."""
    if isinstance(tensors, torch.Tensor) or hasattr(tensors, "__cuda_array_interface__"):
        raise TypeError(
            f"pyddp.{what} takes a list with one tensor per replica (pyddp.{what}([t0, t1])); "
            f"got one {type(tensors).__name__}, whose rows would be taken for replicas. "
            f"Across processes, one tensor per rank, use torch.distributed.{what}"
        )
    if isinstance(tensors, (str, bytes, dict)) or not hasattr(tensors, "__iter__"):
        raise TypeError(
            f"pyddp.{what}: tensors must be a list or tuple of tensors, one per replica; got "
            f"{type(tensors).__name__}"
        )
    tensors = list(tensors)
    cupy_streams = [_cupy_stream(t) for t in tensors]
    return cupy_streams, _check_tensors(
        what, [_as_tensor(t, i, what) for i, t in enumerate(tensors)]
    )


def _ptrs(tensors: Sequence[torch.Tensor]) -> List[int]:
    return [t.data_ptr() for t in tensors]


def _all_reduce_across(
    tensors: Sequence[torch.Tensor], cupy_streams: Sequence[Any], op: str, group: Any
) -> None:
    if tensors[0].device.type != "cpu":
        raise NotImplementedError(
            "all_reduce across processes: GPU tensors need a cross-process NCCL communicator, "
            "which this version does not build yet; use torch.distributed.all_reduce"
        )
    _reduce_in_process(tensors, cupy_streams, "sum")
    all_reduce_blocking(tensors[0], len(tensors), op, group)
    for t in tensors[1:]:
        t.copy_(tensors[0])


def _check_tensors(what: str, tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """One per replica: same shape and dtype, dense, contiguous, apart."""
    if not tensors:
        raise ValueError(f"{what}: tensors is empty")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            raise ValueError(
                f"{what}: tensors[{i}] is {t.layout}; sparse tensors are not supported, "
                "pass dense ones (.to_dense())"
            )
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"{what}: tensors[{i}] is on {t.device}; pass CPU or CUDA tensors (with data)"
            )
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(
                f"{what}: tensors[{i}] is {tuple(t.shape)} {t.dtype}, tensors[0] is "
                f"{tuple(first.shape)} {first.dtype}"
            )
        if not t.is_contiguous():
            raise ValueError(f"{what}: tensors[{i}] is not contiguous; call .contiguous()")
        if t.is_neg() or t.is_conj():  # its memory holds the other sign: read raw, wrong
            raise ValueError(
                f"{what}: tensors[{i}] is a lazily negated or conjugated view (.conj().imag, "
                "torch._neg_view); call .resolve_neg() (or .clone()) first"
            )
    if first.dtype not in DTYPE_NAMES:
        raise ValueError(
            f"{what}: dtype {first.dtype} is not supported (floating point only: "
            f"{', '.join(sorted(str(d) for d in DTYPE_NAMES))})"
        )
    _check_disjoint(what, tensors)
    return tensors


def _check_disjoint(what: str, tensors: Sequence[torch.Tensor]) -> None:
    """Every replica reads all others while writing its own, so two entries that
    share a byte (the same tensor twice, or views like buf[0:4] and buf[2:6])
    would give wrong sums: refuse them. Entries are contiguous here, so each
    covers the bytes [data_ptr, data_ptr + nbytes); addresses are unique across
    CPU and GPUs (CUDA's unified virtual addressing), so devices need no
    separate check. Sorted by start, any overlap shows between neighbours."""
    spans = sorted((t.data_ptr(), t.nbytes, i) for i, t in enumerate(tensors) if t.nbytes)
    for (start_a, size_a, a), (start_b, size_b, b) in zip(spans, spans[1:]):
        if start_b < start_a + size_a:
            i, j = min(a, b), max(a, b)
            common = min(start_a + size_a, start_b + size_b) - start_b
            how = (
                "are the same tensor"
                if tensors[i] is tensors[j]
                else f"overlap in memory ({common} bytes in common)"
            )
            raise ValueError(
                f"{what}: tensors[{i}] and tensors[{j}] {how}; pass one separate buffer per replica"
            )


def _record_streams(tensors: Sequence[torch.Tensor], cupy_streams: Sequence[Any]) -> None:
    """Before the launch, so a failed one is covered too: the caching
    allocator must not hand this memory out again before the current stream
    (which waits for the reduction) gets there."""
    for t, cs in zip(tensors, cupy_streams):
        if t.device.type == "cuda" and cs is None:
            t.record_stream(torch.cuda.current_stream(t.device))


def _cupy_stream(x: Any) -> Any:
    """CuPy's current stream on the array's device (None for torch tensors)."""
    if isinstance(x, torch.Tensor) or not hasattr(x, "__cuda_array_interface__"):
        return None
    import cupy

    with cupy.cuda.Device(x.device.id):
        return cupy.cuda.get_current_stream().ptr


def _as_tensor(x: Any, i: int, what: str = "all_reduce") -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return torch.as_tensor(x)  # zero copy on the array's own device: shares its memory
    raise TypeError(
        f"{what}: tensors[{i}] is {type(x).__name__}; pass torch tensors or CUDA arrays (CuPy)"
    )
