"""Which CUDA stream is current, per device and thread: the one seam between
pyddp's GPU path and torch's stream state. GradSync asks it for the stream a
gradient was produced on (post-accumulate hooks run on the producing stream),
the workers carry the caller's streams into their threads, and the test suite
swaps in the simulated driver's streams (tests/simgpu) where torch has no CUDA.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Sequence

import torch


class TorchStreams:
    """torch.cuda's current streams; handles are raw CUstream integers."""

    def __init__(self, devices: Sequence[int]):
        self.devices = list(devices)

    def current(self, device: int) -> int:
        return torch.cuda.current_stream(device).cuda_stream

    def snapshot(self) -> Dict[int, Any]:
        return {d: torch.cuda.current_stream(d) for d in set(self.devices)}

    @contextlib.contextmanager
    def use(self, snapshot: Dict[int, Any]) -> Iterator[None]:
        # torch.cuda.stream sets the current stream of the stream's device only:
        # one context per device.
        device = torch.cuda.current_device()
        with contextlib.ExitStack() as stack:
            for stream in snapshot.values():
                stack.enter_context(torch.cuda.stream(stream))
            # torch.cuda.stream also makes its stream's device current: keep
            # this worker's own device (each context restores it on exit).
            torch.cuda.set_device(device)
            yield

    def before_host_write(self, device: int) -> None:
        """torch ops are queued on the current stream: nothing to do."""
