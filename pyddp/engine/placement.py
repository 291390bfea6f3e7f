"""Which replicas are GPUs, as the engine sees them: CUDA device indices and
the stream provider (streams.py) that says which stream is current. For CUDA
tensors these come from torch. The one test seam of the GPU path is here: the
test suite (tests/simgpu) runs pyddp's GPU code on a simulated CUDA driver and
NCCL, with host tensors standing in for device memory, by installing its
devices and streams around the calls that build a GradSync, a wrapped model or
an all_reduce (`simulated_gpus`). No product signature carries it."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch

from .streams import TorchStreams

Placement = Tuple[List[int], Any]  # (CUDA device index per replica, stream provider)

_installed = threading.local()


def gpu_placement(devices: Sequence[torch.device], what: str) -> Optional[Placement]:
    """The GPU placement of replicas (or tensors) on `devices`, None for CPUs."""
    simulated = getattr(_installed, "placement", None)
    if simulated is not None and devices[0].type == "cpu":
        indices, streams = simulated
        if len(indices) != len(devices):
            raise ValueError(f"{what}: the simulated GPUs must name one device per replica")
        return list(indices), streams
    if devices[0].type == "cuda":
        indices = [d.index for d in devices]
        return indices, TorchStreams(indices)
    return None


@contextlib.contextmanager
def simulated_gpus(devices: Sequence[int], streams: Any) -> Iterator[None]:
    """The test suite's seam: inside the block (this thread), CPU replicas and
    tensors are GPU `devices` whose streams `streams` provides (the simulated
    driver's). Read when a GradSync or an all_reduce starts, never later."""
    previous = getattr(_installed, "placement", None)
    _installed.placement = (list(devices), streams)
    try:
        yield
    finally:
        _installed.placement = previous
