"""Which CUDA stream is current, per device and thread: the one seam between
pyddp's GPU path and torch's stream state. GradSync asks it for the stream a
gradient was produced on (post-accumulate hooks run on the producing stream),
the workers carry the caller's streams into their threads, and the test suite
swaps in the simulated driver's streams (tests/simgpu) where torch has no CUDA.

Which replicas are GPUs, as the engine sees them (`gpu_placement`): CUDA
device indices and the stream provider. For CUDA tensors these come from
torch. The one test seam of the GPU path is here too: the test suite
(tests/simgpu) runs pyddp's GPU code on a simulated CUDA driver and NCCL, with
host tensors standing in for device memory, by installing its devices and
streams around the calls that build a GradSync, a wrapped model or an
all_reduce (`simulated_gpus`). No product signature carries it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch


def cuda_stream_handle(device: int, stream_id: int) -> int:
    """The CUstream of torch's CUDA stream `stream_id` on `device` (an id
    of c10's stream state, as pyddp._hot's hooks read it)."""
    cuda = 1  # c10::DeviceType::CUDA
    return torch.cuda.Stream(stream_id=stream_id, device_index=device, device_type=cuda).cuda_stream


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

    def hot_source(self) -> None:
        """pyddp._hot's C++ hooks read torch's stream state themselves (c10),
        with cuda_stream_handle for each stream they meet the first time; a
        provider without torch's streams gives the C entry points of its
        current(), before_host_write() and produced() instead."""
        return None

    def capturing(self, device: int) -> bool:
        """Whether the current stream is capturing a CUDA graph."""
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()

    def zeros(self, count: int, dtype: torch.dtype, device: int) -> torch.Tensor:
        """A bucket's memory on `device` (the simulation adds guard zones)."""
        return torch.zeros(count, dtype=dtype, device=torch.device("cuda", device))

    def retire(self, tensors: Sequence[torch.Tensor], device: int) -> None:
        """`tensors` are about to be dropped while the current stream of
        `device` may still use them: the caching allocator must not hand
        their blocks to another allocation of their allocation stream before
        that stream gets past this point (Tensor.record_stream)."""
        stream = torch.cuda.current_stream(device)
        for t in tensors:
            t.record_stream(stream)

    def upload(self, device: int, host: torch.Tensor) -> torch.Tensor:
        """A copy of `host` on `device`, queued on its current stream from
        pinned memory: the host does not wait for it."""
        with torch.cuda.device(device):
            return host.pin_memory().to(torch.device("cuda", device), non_blocking=True)

    def fetch(self, device: int, tensor: torch.Tensor) -> HostCopy:
        """`tensor`'s values on their way to pinned host memory, queued on
        the current stream of `device`; read them when ready()."""
        with torch.cuda.device(device):
            out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            out.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return HostCopy(out, event.query, event.synchronize)

    def timing_event(self, device: int) -> Any:
        """An event with timing, recorded now on the current stream of
        `device` (GpuClock)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def event_done(self, event: Any) -> bool:
        """Whether the GPU passed `event` (asked, never waited for)."""
        return bool(event.query())

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """GPU milliseconds from `start` to `end`, both done."""
        return float(start.elapsed_time(end))

    # produced(device, tensor): autograd has just queued the write of a
    # gradient on the current stream. On a GPU it lands there in stream order
    # by itself: nothing to do, so no call per parameter per step (None). The
    # simulated driver's provider makes it land late, so that a reduction not
    # ordered after that stream reads the wrong values.
    produced = None


class HostCopy:
    """A device tensor's values on their way to the host: ready() asks
    without waiting; get() waits for them if need be (a host wait)."""

    def __init__(self, out: torch.Tensor, query: Any, synchronize: Any):
        self._out, self._query, self._synchronize = out, query, synchronize
        self._done = False

    def ready(self) -> bool:
        self._done = self._done or bool(self._query())
        return self._done

    def get(self) -> torch.Tensor:
        if not self.ready():
            self._synchronize()
            self._done = True
        return self._out


class StreamOrder:
    """The stream ordering of one GradSync's buckets: before the host or a
    stream writes a replica's buckets, the reductions still reading them come
    first (on the GPU: an event wait, not a host sync, so the host keeps
    queuing work). CPU replicas (no provider) need nothing: their reductions
    are done when finish() returns."""

    def __init__(self, devices: Any, provider: Any):
        self.devices = None if devices is None else list(devices)  # CUDA index per replica
        self.provider = provider  # TorchStreams, the simulation's, or None (CPU)

    def current(self) -> list:
        """Every replica's current stream (empty on CPU)."""
        if self.provider is None:
            return []
        return [self.provider.current(d) for d in self.devices]

    def use_current(self, engine: Any, replica: int) -> None:
        """The current stream is about to write replica's buckets: order it
        after the reductions still reading them."""
        if self.provider is not None:
            device = self.devices[replica]
            if self.provider.capturing(device):
                raise RuntimeError(
                    "pyddp: a forward of a wrapped model inside CUDA graph capture "
                    "(torch.cuda.graph, torch.compile mode='reduce-overhead'): pyddp's reductions "
                    "are launched from another thread and watched with event queries, which a "
                    "capture forbids; capture the model's own parts, not the wrapped model"
                )
            engine.use_stream(replica, self.provider.current(device))
            self.provider.before_host_write(device)

    def zeros(self, count: int, dtype: torch.dtype, replica: int) -> torch.Tensor:
        """Memory for one of replica's buckets, zeroed."""
        if self.provider is None:
            return torch.zeros(count, dtype=dtype)
        return self.provider.zeros(count, dtype, self.devices[replica])

    def fence(self, replica: int) -> None:
        """The host is about to write replica's buckets."""
        if self.provider is not None:
            self.provider.before_host_write(self.devices[replica])

    def fence_all(self) -> None:
        """Before the host writes every replica's buckets: the reductions
        still using them come first in stream order (torch: nothing to do,
        its ops are queued on the current streams; the simulation drains
        them)."""
        if self.provider is not None:
            for d in set(self.devices):
                self.provider.before_host_write(d)

    def retire(self, engine: Any, old: Sequence[Sequence[torch.Tensor]]) -> None:
        """`old[r]`: replica r's bucket memory, about to be dropped. Each
        replica's current stream is ordered after the reductions still using
        it, and the caching allocator reuses none of it before that stream
        gets there: the memory may have been allocated on another stream (the
        model built on the default stream, trained under torch.cuda.stream),
        whose next allocation could otherwise take it at once."""
        if self.provider is None:
            return
        for r, tensors in enumerate(old):
            if tensors:
                engine.use_stream(r, self.provider.current(self.devices[r]))
                self.provider.retire(tensors, self.devices[r])


class GpuClock:
    """Whether GPU replicas' steps are bound by the host: per device and per
    backward, the host time from the first replica's forward (prepare) to
    the end of backward (finish), and the GPU time between timing events
    recorded on the current stream at those two points (read once the GPU
    passed both: asked, never waited for). At each forward the event that
    ended the previous backward is asked whether the GPU has passed it: if
    it has, the GPU ran out of queued work (the optimizer step's included)
    before the host started the next forward, so it waited for the host.
    The replicas' threads call begin() concurrently; a few calls per device
    per step, none per parameter."""

    HOST_BOUND = 0.5  # of forwards that found the GPU idle: the verdict "host"
    KEEP = 256  # backwards whose GPU time is still to read, at most

    def __init__(self, provider: Any, devices: Optional[Sequence[int]]):
        self.provider = provider  # None (CPU replicas): does nothing
        self.devices = None if devices is None else list(devices)  # CUDA index per replica
        self._lock = threading.Lock()
        self._open: Dict[int, Tuple[Any, int]] = {}  # device -> (start event, host ns)
        self._ended: Dict[int, Any] = {}  # device -> the event that ended the last backward
        self._pending: List[Tuple[int, Any, Any]] = []  # (device, start, end) to read
        self._sums: Dict[int, List[float]] = {}
        self.failed: Optional[str] = None  # why the measuring stopped
        self.reset()

    @contextlib.contextmanager
    def _or_give_up(self) -> Iterator[None]:
        """A timing event that fails (a dead context: pyddp's own calls name
        it where it matters) ends the measuring; report() says why."""
        try:
            yield
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"
            self._open.clear()
            self._ended.clear()
            self._pending = []

    def reset(self) -> None:
        """Forgets the sums, and the spans still to read (they began before)."""
        with self._lock:
            # device -> [backwards, host ms, GPU ms read, GPU reads, forwards asked, found idle]
            self._sums: Dict[int, List[float]] = {}
            self._pending = []

    def begin(self, replica: int) -> None:
        if self.devices is None or self.failed is not None:
            return
        device = self.devices[replica]
        with self._lock, self._or_give_up():
            if device in self._open:
                return
            ended = self._ended.pop(device, None)
            if ended is not None:
                sums = self._sums.setdefault(device, [0, 0.0, 0.0, 0, 0, 0])
                sums[4] += 1
                sums[5] += self.provider.event_done(ended)
            self._open[device] = (self.provider.timing_event(device), time.perf_counter_ns())

    def end(self) -> None:
        if self.devices is None or self.failed is not None:
            return
        now = time.perf_counter_ns()
        with self._lock, self._or_give_up():
            for device, (start, began) in self._open.items():
                end = self.provider.timing_event(device)
                sums = self._sums.setdefault(device, [0, 0.0, 0.0, 0, 0, 0])
                sums[0] += 1
                sums[1] += (now - began) / 1e6
                self._ended[device] = end
                self._pending.append((device, start, end))
            self._open.clear()
            self._read()

    def _read(self) -> None:
        kept = []
        for device, start, end in self._pending:
            if self.provider.event_done(end):
                sums = self._sums.setdefault(device, [0, 0.0, 0.0, 0, 0, 0])
                sums[2] += self.provider.elapsed_ms(start, end)
                sums[3] += 1
            else:
                kept.append((device, start, end))
        self._pending = kept[-self.KEEP :]

    def stats(self) -> Dict[str, Any]:
        """Per device ("cuda:N"): means over the backwards since reset."""
        out: Dict[str, Any] = {}
        with self._lock:
            if self.failed is None:
                with self._or_give_up():
                    self._read()
            for device, (n, host, gpu, reads, asked, idle) in sorted(self._sums.items()):
                if not n:
                    continue
                waited = idle / asked if asked else None
                bound = None if waited is None else "host" if waited >= self.HOST_BOUND else "gpu"
                out[f"cuda:{device}"] = {
                    "backwards": int(n),
                    "host_ms": host / n,
                    "gpu_ms": gpu / reads if reads else None,
                    "gpu_waited_for_host": waited,
                    "bound": bound,
                }
        return out

    def report(self) -> Dict[str, Any]:
        """stats()'s part: "gpu" (stats()), "gpu_advice" where the host
        bounds the step on some device, "gpu_stopped" once measuring failed."""
        if self.devices is None:
            return {}
        out: Dict[str, Any] = {"gpu": self.stats()}
        if any(d["bound"] == "host" for d in out["gpu"].values()):
            out["gpu_advice"] = HOST_BOUND_ADVICE
        if self.failed is not None:
            out["gpu_stopped"] = f"a timing event failed, the means stop there: {self.failed}"
        return out


HOST_BOUND_ADVICE = (
    "the GPU finished each step's work before the host started the next: the host "
    "(Python: forward, hooks, optimizer, replica by replica under one interpreter "
    "lock) bounds the step. Remedies: a larger batch per GPU; one process per GPU "
    "under torchrun (pyddp across processes, or torch DDP) instead of several GPU "
    "replicas in one process"
)


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
