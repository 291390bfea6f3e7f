"""autograd's per-device backward threads, for the simulated GPUs.

On a GPU, torch's autograd engine runs the backward of CUDA tensors on a
thread of its own per device (created once, kept for the process), not on
the thread that called backward(). Each backward op, and each hook that
follows it (pyddp's gradient hooks, SyncBatchNorm's backward meeting), runs
there with the device's current stream set to the stream its forward op ran
on (torch docs, "Stream semantics of backward passes"); the thread's current
streams of other devices are their default streams. Before the final
callbacks (pyddp's finish), the caller's current streams wait for those
"leaf" streams, and the callbacks run on the caller's streams.

The simulated replicas are host tensors, so torch would run every replica's
backward on the calling thread with the caller's streams. pyddp's wrapped
model asks its stream provider for `autograd_backward` (None on a GPU, where
autograd does this itself) and the simulation runs each replica's backward
as autograd would run it on GPUs:

- on one persistent thread per device, its context current (as
  cudaSetDevice); replicas sharing a device run there one after another,
  so a hook that waited for another replica of its own device would hang
  as on a GPU (SyncBatchNorm refuses replicas sharing a GPU for this reason);
- with the device's current stream the one current on the thread that ran
  that replica's forward, when it ran (noted by a module forward pre-hook,
  independently of pyddp's own stream queries), so gradients land there;
- then the caller's current streams wait for those streams (an event each,
  no host wait), and an error is raised as it was raised, after every device
  thread stopped (a device's remaining replicas are skipped, as autograd
  stops a graph task that failed).

Not modelled: one stream per op (the whole replica's backward uses its
forward's stream at the replica's top module; a model switching streams
inside its forward would differ); autograd interleaving the ready nodes of
two replicas on one device thread (here replica order); a backward of one
replica per process, which torch runs on the calling thread here."""

from __future__ import annotations

import concurrent.futures
import ctypes
import threading
import weakref
from typing import Any, Callable, Dict, List, Sequence

import torch


class DeviceThreads:
    """One stream provider's autograd device threads (see the module)."""

    def __init__(self, streams: Any):
        self.streams = streams
        self.sim = streams.sim
        self._lock = threading.Lock()
        self._threads: Dict[int, concurrent.futures.ThreadPoolExecutor] = {}
        self._forward: weakref.WeakKeyDictionary[torch.nn.Module, Dict[int, int]]
        self._forward = weakref.WeakKeyDictionary()
        self.idents: Dict[int, int] = {}  # device -> its thread's ident, once started
        self.backwards = 0  # replica backwards run here
        # For the process: the simulated tier's scenarios each run in one.
        torch.nn.modules.module.register_module_forward_pre_hook(self._note)

    def _note(self, module: torch.nn.Module, args: Any) -> None:
        """A module's forward begins: the current streams of this thread
        (autograd records each op's stream as its node is made)."""
        snapshot = self.streams.snapshot()
        with self._lock:
            self._forward[module] = snapshot

    def forward_stream(self, module: torch.nn.Module, device: int) -> int:
        with self._lock:
            noted = self._forward.get(module)
        if noted is None:
            raise AssertionError(f"simgpu: no forward noted for {type(module).__name__}")
        return noted.get(device, 0)

    def _thread(self, device: int) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            pool = self._threads.get(device)
            if pool is None:

                def start() -> None:
                    self.streams.set_device(device)  # as autograd's device thread
                    self.idents[device] = threading.get_ident()

                pool = concurrent.futures.ThreadPoolExecutor(
                    1, f"simgpu-autograd-cuda:{device}", initializer=start
                )
                self._threads[device] = pool
            return pool

    def run(
        self,
        devices: Sequence[int],
        modules: Sequence[torch.nn.Module],
        fns: Sequence[Callable[[], None]],
    ) -> None:
        """fns[r]: replica r's backward (its module modules[r], on GPU
        devices[r]); returns once every device thread is done."""
        caller = {d: self.streams.current(d) for d in set(devices)}  # CUstream handles
        jobs: Dict[int, List[Any]] = {}
        for r, d in enumerate(devices):
            jobs.setdefault(d, []).append((fns[r], self.forward_stream(modules[r], d)))
        first: List[BaseException] = []

        def device_backward(device: int, work: List[Any]) -> None:
            for fn, stream in work:
                with self.streams.use({device: stream}):
                    try:
                        fn()
                    except BaseException as e:
                        with self._lock:
                            first.append(e)
                        return
                with self._lock:
                    self.backwards += 1

        futures = [self._thread(d).submit(device_backward, d, w) for d, w in jobs.items()]
        concurrent.futures.wait(futures)
        for f in futures:
            f.result()  # the simulation's own failure, if any
        if first:
            raise first[0]
        for d, work in jobs.items():  # the caller's streams wait for the leaf streams
            for stream in {_handle(s) for _, s in work} - {caller[d]}:
                self._join(d, stream, caller[d])

    def _join(self, device: int, leaf: int, caller: int) -> None:
        lib = self.sim.lib
        event = ctypes.c_void_p()
        with self.sim.on_device(device):
            assert lib.cuEventCreate(ctypes.byref(event), 2) == 0  # CU_EVENT_DISABLE_TIMING
            try:
                assert lib.cuEventRecord(event, leaf) == 0
                assert lib.cuStreamWaitEvent(caller, event, 0) == 0
            finally:
                lib.cuEventDestroy_v2(event)


def _handle(stream: Any) -> int:
    """A provider's stream (a CUstream handle, or torch.cuda.Stream's face)."""
    return getattr(stream, "cuda_stream", stream)
