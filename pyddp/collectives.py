"""Collectives over a list of per-replica tensors in one process, in place."""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch

from . import _C
from .sync import _DTYPE_NAMES

_backend: Optional[_C.CpuBackend] = None
_backend_lock = threading.Lock()


def all_reduce(tensors: Sequence[torch.Tensor], op: str = "sum") -> None:
    """Reduces `tensors` (one per replica, same shape and dtype, contiguous, on
    the CPU) in place: afterwards each holds the sum (op="sum") or the mean
    (op="avg") of all. float16/bfloat16 accumulate in float32."""
    global _backend
    tensors = list(tensors)
    if not tensors:
        raise ValueError("all_reduce: tensors is empty")
    if op not in ("sum", "avg"):
        raise ValueError(f"all_reduce: op={op!r}, use 'sum' or 'avg'")
    first = tensors[0]
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_reduce: tensors[{i}] is {type(t).__name__}, not a tensor")
        if t.device.type != "cpu":
            raise ValueError(f"all_reduce: tensors[{i}] is on {t.device}; only CPU for now")
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ValueError(
                f"all_reduce: tensors[{i}] is {tuple(t.shape)} {t.dtype}, tensors[0] is "
                f"{tuple(first.shape)} {first.dtype}"
            )
        if not t.is_contiguous():
            raise ValueError(f"all_reduce: tensors[{i}] is not contiguous; call .contiguous()")
    if first.dtype not in _DTYPE_NAMES:
        raise ValueError(f"all_reduce: dtype {first.dtype} is not supported")
    if len({t.data_ptr() for t in tensors if t.numel()}) < sum(1 for t in tensors if t.numel()):
        raise ValueError("all_reduce: two entries share memory; pass one buffer per replica")
    with _backend_lock:
        if _backend is None:
            _backend = _C.CpuBackend()
    _backend.all_reduce(
        [t.data_ptr() for t in tensors], first.numel(), _DTYPE_NAMES[first.dtype], op
    )
