"""pyddp's own GPU stream provider (`TorchStreams`, pyddp/engine/streams.py)
run on the simulated driver.

On a GPU, pyddp's stream state comes from `TorchStreams`: torch.cuda's current
streams, `torch.cuda.stream` to carry them into the replica workers,
`Tensor.record_stream` to retire bucket memory, `torch.cuda.Event` for the
GPU clock, `torch.cuda.is_current_stream_capturing` for captured steps. The
CPU wheel has no CUDA, so the rest of the simulated tier uses `SimStreams`, a
provider of its own, and TorchStreams' code would run only on a GPU.

`torch_cuda_on(streams)` puts a stand-in for those few torch.cuda calls (and
`Tensor.record_stream`) in place, on the simulated driver, with torch's
semantics: thread-local current device and per-device current streams
(default stream: handle 0); `torch.cuda.stream(s)` makes `s` current on its
device and its device current for the block, restoring both after;
`record_stream` marks the block for the simulated caching allocator's check
(SimStreams.record_stream). `TorchStreamsOnSim` is then TorchStreams'
own methods for everything stream-related, with SimStreams' memory (guarded
allocations, late gradient writes, host-write drains), which torch could
only give with a CUDA build.

What does not run: torch's C++ (c10's stream pool and state, the caching
allocator's record_stream, autograd's device threads, which
device_threads.py models). The C++ gradient hooks read the simulated
driver's current streams, which this stand-in sets, instead of c10's."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from typing import Any, Iterator, Optional

import torch
from simgpu import SimStreams, _raise_as_torch

from pyddp.engine.streams import TorchStreams


class Stream:
    """torch.cuda.Stream's face: `cuda_stream` (the CUstream), `device`."""

    def __init__(self, handle: int, device: int):
        self.cuda_stream, self.device_index = handle, device
        self.device = torch.device("cuda", device)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and (self.cuda_stream, self.device_index) == (
            other.cuda_stream,
            other.device_index,
        )

    def __hash__(self) -> int:
        return hash((self.cuda_stream, self.device_index))

    def __repr__(self) -> str:
        where = f"device={self.device_index} cuda_stream={self.cuda_stream:#x}"
        return f"<simulated torch.cuda.Stream {where}>"


def _index(device: Any) -> Optional[int]:
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device.index
    return int(device)


class TorchCuda:
    """The torch.cuda calls TorchStreams makes, on the simulated driver."""

    def __init__(self, streams: SimStreams):
        self.streams, self.sim = streams, streams.sim
        self._local = threading.local()
        self.recorded = 0  # Tensor.record_stream calls

    # current device ---------------------------------------------------
    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, device: Any) -> None:
        index = _index(device)
        self._local.device = index
        self.sim.use_device(index)  # as cudaSetDevice: the primary context current

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        saved = self.current_device()
        self.set_device(device)
        try:
            yield
        finally:
            self.set_device(saved)

    # streams ----------------------------------------------------------
    def current_stream(self, device: Any = None) -> Stream:
        index = self.current_device() if _index(device) is None else _index(device)
        return Stream(SimStreams.current(self.streams, index), index)

    def Stream(self, device: Any = None) -> Stream:
        index = self.current_device() if _index(device) is None else _index(device)
        with self.sim.on_device(index):  # (torch's current device stays)
            return Stream(self.sim.stream(index), index)

    def ExternalStream(self, stream_ptr: int, device: Any = None) -> Stream:
        index = self.current_device() if _index(device) is None else _index(device)
        return Stream(stream_ptr, index)

    @contextlib.contextmanager
    def stream(self, stream: Optional[Stream]) -> Iterator[None]:
        if stream is None:  # torch: a no-op
            yield
            return
        with self.device(stream.device_index):
            index = stream.device_index
            saved = SimStreams.current(self.streams, index)
            assert self.sim.lib.simgpu_set_current_stream(index, stream.cuda_stream) == 0
            try:
                yield
            finally:
                self.sim.lib.simgpu_set_current_stream(index, saved)

    def is_current_stream_capturing(self) -> bool:
        return SimStreams.capturing(self.streams, self.current_device())

    # events -----------------------------------------------------------
    def Event(self, enable_timing: bool = False) -> Event:
        return Event(self, enable_timing)

    # Tensor.record_stream ---------------------------------------------
    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        self.recorded += 1
        self.streams.record_stream(tensor, stream.cuda_stream)


class Event:
    """torch.cuda.Event's face on a simulated event (created at record())."""

    def __init__(self, cuda: TorchCuda, enable_timing: bool):
        self.cuda, self.timing = cuda, enable_timing
        self.handle: Optional[int] = None

    def record(self, stream: Optional[Stream] = None) -> None:
        cuda, lib = self.cuda, self.cuda.sim.lib
        stream = stream or cuda.current_stream()
        with cuda.sim.on_device(stream.device_index):
            if self.handle is None:
                event = ctypes.c_void_p()
                _raise_as_torch(lib.cuEventCreate(ctypes.byref(event), 0 if self.timing else 2))
                self.handle = event.value
                weakref.finalize(self, lib.cuEventDestroy_v2, event.value)
            _raise_as_torch(lib.cuEventRecord(self.handle, stream.cuda_stream))

    def query(self) -> bool:
        if self.handle is None:
            return True
        code = self.cuda.sim.lib.cuEventQuery(self.handle)
        if code != 600:  # CUDA_ERROR_NOT_READY
            _raise_as_torch(code)
        return code == 0

    def synchronize(self) -> None:
        if self.handle is not None:
            _raise_as_torch(self.cuda.sim.lib.cuEventSynchronize(self.handle))

    def elapsed_time(self, end: Event) -> float:
        ms = ctypes.c_float()
        lib = self.cuda.sim.lib
        _raise_as_torch(lib.cuEventElapsedTime(ctypes.byref(ms), self.handle, end.handle))
        return ms.value


NAMES = ("current_device", "set_device", "device", "current_stream", "Stream", "stream",
         "is_current_stream_capturing", "Event", "ExternalStream")  # fmt: skip


@contextlib.contextmanager
def torch_cuda_on(streams: SimStreams) -> Iterator[TorchCuda]:
    """torch.cuda's stream and event calls (and Tensor.record_stream) on the
    simulated driver inside the block."""
    cuda = TorchCuda(streams)
    saved = {n: getattr(torch.cuda, n) for n in NAMES}
    saved_record = torch.Tensor.record_stream
    for n in NAMES:
        setattr(torch.cuda, n, getattr(cuda, n))
    torch.Tensor.record_stream = lambda self, stream: cuda.record_stream(self, stream)
    try:
        yield cuda
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)
        torch.Tensor.record_stream = saved_record


class TorchStreamsOnSim(SimStreams):
    """TorchStreams' methods for the stream state (under torch_cuda_on),
    SimStreams' for memory and the simulation's late writes."""

    def __init__(self, sim: Any, devices: Any):
        super().__init__(sim)
        self.devices = list(devices)

    def set_device(self, device: int) -> None:
        torch.cuda.set_device(device)

    current = TorchStreams.current
    snapshot = TorchStreams.snapshot
    use = TorchStreams.use
    on = TorchStreams.on
    capturing = TorchStreams.capturing
    retire = TorchStreams.retire
    timing_event = TorchStreams.timing_event
    event_done = TorchStreams.event_done
    elapsed_ms = TorchStreams.elapsed_ms
