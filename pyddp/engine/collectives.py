"""Collectives over a list of per-replica tensors in one process, in place:
CPU tensors reduce in process, one tensor per GPU through NCCL, several on one
GPU through pyddp's kernel. CuPy arrays (anything with
``__cuda_array_interface__``) are accepted and modified in place, ordered
against CuPy's current stream. Backends share the process-wide communicators
of their devices with every wrapped model (one launch lock per device set)."""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .._link import resolve_group
from .._link.transport import all_reduce_blocking
from ..errors import ReduceError
from ..runtime.libraries import DTYPE_NAMES, backend_kind, make_backend
from .placement import gpu_placement

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
    cupy_streams = [_cupy_stream(t) for t in tensors]
    tensors = [_as_tensor(t, i) for i, t in enumerate(tensors)]
    if not tensors:
        raise ValueError("all_reduce: tensors is empty")
    if op not in ("sum", "avg"):
        raise ValueError(f"all_reduce: op={op!r}, use 'sum' or 'avg'")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            raise ValueError(
                f"all_reduce: tensors[{i}] is {t.layout}; sparse tensors are not supported, "
                "pass dense ones (.to_dense())"
            )
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(
                f"all_reduce: tensors[{i}] is {tuple(t.shape)} {t.dtype}, tensors[0] is "
                f"{tuple(first.shape)} {first.dtype}"
            )
        if not t.is_contiguous():
            raise ValueError(f"all_reduce: tensors[{i}] is not contiguous; call .contiguous()")
    if first.dtype not in DTYPE_NAMES:
        raise ValueError(f"all_reduce: dtype {first.dtype} is not supported")
    _check_disjoint(tensors)
    xgroup = resolve_group(group)
    if xgroup is not None:
        _all_reduce_across(tensors, cupy_streams, op, xgroup)
    else:
        _reduce_in_process(tensors, cupy_streams, op)


def _reduce_in_process(
    tensors: Sequence[torch.Tensor],
    cupy_streams: Sequence[Any],
    op: str,
) -> None:
    """The reduction over this process's tensors (already checked), ordered
    on each device's current stream through the stream provider GradSync
    uses (torch's; the simulation's in the test suite)."""
    if len(tensors) == 1:
        return  # the sum and the mean of one tensor is itself
    first = tensors[0]
    gpu = gpu_placement([t.device for t in tensors], "all_reduce")
    if gpu is not None:
        indices, provider = tuple(gpu[0]), gpu[1]
        places: List[Any] = list(indices)
    else:
        places = [t.device for t in tensors]
        indices, provider = (-1,) * len(places), None
    kind = backend_kind(places)
    key = (kind, indices)
    with _backends_lock:
        if key not in _backends:
            _backends[key] = (make_backend(places), threading.Lock())
        backend, lock = _backends[key]
    streams = [
        0 if provider is None else (cs if cs is not None else provider.current(i))
        for i, cs in zip(indices, cupy_streams)
    ]
    with lock:
        try:
            _record_streams(tensors, cupy_streams)
            backend.reduce(
                [t.data_ptr() for t in tensors],
                list(indices),
                streams,
                first.numel(),
                DTYPE_NAMES[first.dtype],
                op,
            )
        except ReduceError:
            with _backends_lock:
                _backends.pop(key, None)
            raise


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


def _check_disjoint(tensors: Sequence[torch.Tensor]) -> None:
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
            what = (
                "are the same tensor"
                if tensors[i] is tensors[j]
                else f"overlap in memory ({common} bytes in common)"
            )
            raise ValueError(
                f"all_reduce: tensors[{i}] and tensors[{j}] {what}; pass one separate "
                "buffer per replica"
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


def _as_tensor(x: Any, i: int) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return torch.as_tensor(x)  # zero copy on the array's own device: shares its memory
    raise TypeError(
        f"all_reduce: tensors[{i}] is {type(x).__name__}; pass torch tensors or CUDA arrays (CuPy)"
    )
