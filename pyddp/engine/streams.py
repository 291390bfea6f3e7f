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
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from .. import _C


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

    def side_stream(self, device: int) -> int:
        """A stream of torch's on `device` (from its pool: never destroyed),
        as a raw CUstream."""
        return torch.cuda.Stream(device=torch.device("cuda", device)).cuda_stream

    @contextlib.contextmanager
    def on(self, device: int, handle: int) -> Iterator[None]:
        """In the block, torch ops on `device` queue on the raw CUstream
        `handle` (side_stream's, where a Python communication hook runs),
        after what that stream holds already."""
        stream = torch.cuda.ExternalStream(handle, device=torch.device("cuda", device))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            # (The simulation's host tensors: its provider drains the stream.)
            self.before_host_write(device)
            yield

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

    # autograd_backward(devices, modules, fns): runs the replicas' backwards
    # where autograd would on GPUs. On a GPU autograd does it by itself (a
    # thread per device, each op on its forward's stream), so pyddp never
    # asks (None). The simulated replicas are host tensors, which torch would
    # run on the calling thread: the simulation's provider does what autograd
    # does, and the wrapped model calls it for them.
    autograd_backward = None


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

    def capturing(self, replica: int) -> bool:
        """Whether replica's current stream captures a CUDA graph (StepCapture)."""
        return self.provider is not None and self.provider.capturing(self.devices[replica])

    def use_current(self, engine: Any, replica: int, captured: bool = False) -> None:
        """The current stream is about to write replica's buckets: order it
        after the reductions still reading them (`captured`: it captures a
        graph, whose work the host does not write)."""
        if self.provider is not None:
            device = self.devices[replica]
            engine.use_stream(replica, self.provider.current(device))
            if not captured:
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


class StepCapture:
    """The capture state of one Reducer's current backward. A step of GPU
    replicas captured into a CUDA graph (torch.cuda.graph around forward,
    backward and the optimizer step) and replayed is the step as pyddp runs
    it with the host taken out. A replica whose forward starts on a
    capturing stream makes the backward a captured one. pyddp then queues the
    same work as eagerly on the capturing streams (the ready events, the
    communication streams' waits on them, NCCL or the shared-GPU kernel, the
    fence back into the caller's streams), so the graph holds the reductions
    and every replay runs them; what only the host does is left out of the
    capture or refused by name:

    - the watchdog does not watch captured launches (their events are the
      graph's: no query may ask them); the graph's launcher owns them, as torch's
      ProcessGroupNCCL leaves captured collectives to it;
    - the GPU timing events (stats()["gpu"]) and the per-backward statistics are
      not taken: a captured backward is counted in stats()["captured_backwards"];
    - refused: a step across processes (its agreement is read on the host),
      before the first synced backward laid out the buckets again (a capture
      holds their addresses), sharded gradients (buckets allocated as gradients
      arrive), a parameter left without a gradient (settled on the host), and
      replicas of which some capture and some do not.

    Replays run no host code: the step's host state (the gradients' `.grad`
    pointing at their buckets, the engine between backwards) stays as the
    captured step left it, and each replay redoes the whole of the step on the
    GPU. Replay on the capturing stream's successor (torch: the current stream),
    after pyddp's eager steps: an eager finish() orders the caller's streams
    after its reductions, and a graph's launch after the work queued before it."""

    def __init__(self) -> None:
        self.replicas: Set[int] = set()  # prepared on a capturing stream this backward
        self.eager: Set[int] = set()  # prepared on streams that capture nothing
        self.backwards = 0  # captured backwards (stats()["captured_backwards"])

    @property
    def active(self) -> bool:
        return bool(self.replicas)

    def at_prepare(self, reducer: Any, replica: int) -> bool:
        """Whether replica `replica`'s forward starts a captured backward;
        raises what a capture cannot hold, the step dropped."""
        captured = reducer._order.capturing(replica)
        if captured or self.replicas:  # (else nothing to refuse: an eager step)
            with self._or_drop(reducer._engine):
                if captured:
                    self.begin(reducer, replica)
                else:
                    self.begin_eager(replica)
        else:
            self.eager.add(replica)
        if not captured:
            reducer._clock.begin(replica)  # (GPU timing: eager backwards only)
        return captured

    def at_finish(self, reducer: Any) -> bool:
        """At finish(): whether the backward was captured; raises what a
        replay could not redo, the backward dropped."""
        if not self.replicas:
            return False
        with self._or_drop(reducer._engine):
            self.check_end(len(reducer._replicas), reducer._engine.unmarked())
        return True

    @contextlib.contextmanager
    def _or_drop(self, engine: Any) -> Iterator[None]:
        """A refusal inside drops the step before it propagates."""
        try:
            yield
        except RuntimeError:
            self.drop(engine)
            raise

    def drop(self, engine: Any) -> None:
        """A step refused for capture: its backward, if one began, is
        dropped (as abort() drops a failed one); eager steps go on."""
        self.reset()
        if engine.active:
            engine.abort()

    def begin(self, reducer: Any, replica: int) -> None:
        """Replica `replica`'s forward starts on a capturing stream: raises,
        naming it, what a capture cannot hold."""
        why = _not_capturable(reducer)
        if replica in self.eager:  # its own earlier forward: a step with no backward
            self.eager.clear()
        if why is None and self.eager:
            why = (
                f"replicas {sorted(self.eager)} started this step on streams that capture "
                f"nothing and replica {replica} on a capturing one: {_TAKE_PART}"
            )
        if why is not None:
            _refuse(why)
        self.replicas.add(replica)

    def begin_eager(self, replica: int) -> None:
        """Replica `replica`'s forward starts on a stream that captures
        nothing: refused if others of this backward's started on capturing
        ones (those before them are named at finish())."""
        if self.replicas:
            _refuse(
                f"replicas {sorted(self.replicas)} started it on capturing streams and replica "
                f"{replica} on one that is not: {_TAKE_PART}"
            )
        self.eager.add(replica)

    def check_end(self, replicas: int, unmarked: List[Any]) -> None:
        """At finish() of a captured backward: every replica took part, and
        every parameter got its gradient on every replica."""
        missing = sorted(set(range(replicas)) - self.replicas)
        why = None
        if missing:
            why = f"replicas {missing} ran no forward on a capturing stream: {_TAKE_PART}"
        elif unmarked:
            shown = ", ".join(f"replica {r} parameter {i}" for r, i in list(unmarked)[:5])
            why = (
                f"no gradient for {shown}{' ...' if len(unmarked) > 5 else ''}: pyddp settles a "
                "parameter without one on the host, which a replay would not redo (capture a "
                "step where every parameter gets its gradient)"
            )
        if why is not None:
            _refuse(why)

    def ended(self) -> bool:
        """At the end of finish(), captured or not: whether it was (counted)."""
        captured = bool(self.replicas)
        self.backwards += captured
        self.reset()
        return captured

    def report(self) -> dict:
        """stats()'s part: the backwards captured (not in the means)."""
        return {"captured_backwards": self.backwards} if self.backwards else {}

    def reset(self) -> None:
        self.replicas.clear()
        self.eager.clear()


_TAKE_PART = (
    "every replica's stream must take part in the capture (run each device's work on a "
    "stream that joined it)"
)


def _refuse(why: str) -> None:
    raise RuntimeError(f"pyddp: this step cannot be captured into a CUDA graph: {why}")


def _not_capturable(reducer: Any) -> Any:
    """Why `reducer`'s step cannot be captured now, or None."""
    if reducer._gpu_devices is not None and not _C.cuda_capture_supported():
        return (
            "this CUDA driver lacks cuStreamGetCaptureInfo_v2/_v3 or "
            "cuThreadExchangeStreamCaptureMode, which pyddp needs to keep its reductions in "
            "a capture (update the NVIDIA driver)"
        )
    if reducer._link.spans_processes:
        return (
            "it spans processes: the per-step agreement between processes is read on the "
            "host (capture the replicas of one process, or run this step eagerly)"
        )
    if reducer._plan.rebuild_pending:
        return (
            "no synced backward ran yet: pyddp lays out the buckets again after the first one "
            "(as torch DDP does), and a graph holds their addresses (run a few eager steps "
            "first, as torch.cuda.graph's warm-up asks)"
        )
    if reducer._engine is not None and reducer._engine.learning:
        return (
            "no synced backward ran yet: static_graph's first one counts each gradient's "
            "arrivals and reduces after backward (run a few eager steps first, as "
            "torch.cuda.graph's warm-up asks)"
        )
    if reducer._layout.scattered is not None:
        return (
            "the gradients are sharded (shard='gradients'): their buckets are allocated as "
            "gradients arrive and freed after each reduction"
        )
    return None


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
