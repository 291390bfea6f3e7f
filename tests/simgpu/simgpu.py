"""Python side of the simulated CUDA driver (libsimgpu.so, see simgpu.cpp):
building it, a ctypes handle for the tests' controls, and SimStreams, the
stream provider that stands in for torch.cuda's current streams."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import weakref
from typing import Dict, Iterator, Tuple

from device_threads import DeviceThreads

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KERNEL = os.path.join(ROOT, "csrc", "reduce_kernels.cu")


def fnv1a(data: bytes) -> int:
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) % (1 << 64)
    return h


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def build() -> str:
    """Compiles libsimgpu.so (cached by source hash) and returns its path."""
    sources = [os.path.join(HERE, "simgpu.cpp"), os.path.join(HERE, "kernel_shim.h"), KERNEL]
    digest = hashlib.sha256(b"".join(_read(p) for p in sources)).hexdigest()[:16]
    out_dir = os.path.join(tempfile.gettempdir(), f"pyddp-simgpu-{digest}")
    lib = os.path.join(out_dir, "libsimgpu.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(out_dir, exist_ok=True)
    tmp = lib + f".{os.getpid()}.tmp"
    subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-O1",
            "-shared",
            "-fPIC",
            "-pthread",
            "-fvisibility=hidden",
            f"-I{os.path.join(ROOT, 'csrc')}",
            f"-I{HERE}",
            f"-DSIMGPU_KERNEL_HASH={fnv1a(_read(KERNEL))}ull",
            sources[0],
            "-o",
            tmp,
        ],
        check=True,
    )
    os.replace(tmp, lib)
    return lib


class Sim:
    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        vp = ctypes.c_void_p
        self.lib.simgpu_set_delay_us.argtypes = [vp, ctypes.c_long]
        self.lib.simgpu_sleep.argtypes = [vp, ctypes.c_long]
        self.lib.simgpu_copy.argtypes = [vp, vp, vp, ctypes.c_size_t]
        self.lib.cuStreamGetCaptureInfo_v2.argtypes = [
            vp, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_ulonglong), vp, vp, vp
        ]  # fmt: skip
        self.lib.simgpu_violations.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self.lib.simgpu_counter.argtypes = [ctypes.c_char_p]
        self.lib.simgpu_counter.restype = ctypes.c_long
        size = ctypes.c_size_t
        self.lib.simgpu_alloc.argtypes = [vp, size, size, size, ctypes.c_int, vp]
        self.lib.simgpu_host_use.argtypes = [ctypes.c_int, vp]
        self.lib.simgpu_free.argtypes = [vp, ctypes.POINTER(vp), ctypes.c_int]
        self.lib.simgpu_is_device.argtypes = [vp]
        self.lib.simgpu_host_synchronized.argtypes = [ctypes.c_int, vp]
        self.lib.simgpu_releasable.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
        self.lib.cuStreamCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        self.lib.cuStreamSynchronize.argtypes = [vp]
        self.lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
        self.lib.cuCtxSetCurrent.argtypes = [vp]
        self.lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
        self.lib.cuEventCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        self.lib.cuEventRecord.argtypes = [vp, vp]
        self.lib.cuStreamWaitEvent.argtypes = [vp, vp, ctypes.c_uint]
        self.lib.cuEventQuery.argtypes = [vp]
        self.lib.cuEventSynchronize.argtypes = [vp]
        self.lib.cuEventDestroy_v2.argtypes = [vp]
        self.lib.cuEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), vp, vp]
        self.lib.simgpu_current_stream.restype = vp
        self.lib.simgpu_set_current_stream.argtypes = [ctypes.c_int, vp]
        self.lib.simgpu_set_late_us.argtypes = [ctypes.c_long]
        self.lib.simgpu_produced.argtypes = [ctypes.c_int, vp, vp, size]
        assert self.lib.cuInit(0) == 0

    def use_device(self, device: int) -> None:
        ctx = ctypes.c_void_p()
        assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) == 0
        assert self.lib.cuCtxSetCurrent(ctx) == 0

    def stream(self, device: int) -> int:
        self.use_device(device)
        s = ctypes.c_void_p()
        assert self.lib.cuStreamCreate(ctypes.byref(s), 1) == 0
        return s.value

    def synchronize(self, stream: int, device: int) -> None:
        self.use_device(device)  # stream 0 is the current context's default stream
        with self.harness():
            assert self.lib.cuStreamSynchronize(stream) == 0
        # As torch.cuda.synchronize: the host knows that stream's work is done.
        assert self.lib.simgpu_host_synchronized(device, stream) == 0

    @contextlib.contextmanager
    def harness(self) -> Iterator[None]:
        """The test's own waits inside: not counted as pyddp's host waits."""
        self.lib.simgpu_harness(1)
        try:
            yield
        finally:
            self.lib.simgpu_harness(0)

    @contextlib.contextmanager
    def on_device(self, device: int) -> Iterator[None]:
        """`device`'s context current inside, the caller's again after: the
        simulation's own calls must not do pyddp's context switches for it."""
        saved = ctypes.c_void_p()
        assert self.lib.cuCtxGetCurrent(ctypes.byref(saved)) == 0
        self.use_device(device)
        try:
            yield
        finally:
            assert self.lib.cuCtxSetCurrent(saved) == 0

    def violations(self) -> str:
        buf = ctypes.create_string_buffer(1 << 16)
        n = self.lib.simgpu_violations(buf, len(buf))
        return buf.value.decode() if n else ""

    def counter(self, name: str) -> int:
        return self.lib.simgpu_counter(name.encode())


MAX_DEVICES = 8  # simgpu.cpp's kMaxDevices


class SimStreams:
    """pyddp's stream-provider protocol (see pyddp/engine/streams.py) on the
    simulated driver: thread-local current streams, 0 (the default stream)
    unless set with `stream()`. Host tensor writes stand in for kernels queued
    on the current stream, so before one the current stream is drained.

    Late gradient writes: on a GPU, autograd's write of a gradient is a kernel
    on the producing stream, done some time after the hook runs on the host.
    Here torch wrote it on the host already, so `produced` takes the value
    back out (the buffer reads NaN) and queues its write on the current
    stream after `late_us` (SIMGPU_LATE_US, default 100): a reduction not
    ordered after that stream (a ready event on the wrong stream, a missing
    wait) reads NaN in any test, not only in one built to catch it.

    The current streams, the drain and the late write live in the simulated
    driver (simgpu.cpp, "the test stream provider"), so pyddp._hot's C++
    gradient hooks use them with no Python call (`hot_source`), as they use
    torch's stream state on a GPU."""

    def __init__(self, sim: Sim, late_us: int = -1):
        self.sim = sim
        self.late_us = int(os.environ.get("SIMGPU_LATE_US", "100")) if late_us < 0 else late_us
        self._lock = threading.Lock()
        self._memory: Dict[int, object] = {}  # body address -> its host memory, until released
        self._blocks: Dict[int, int] = {}  # storage address -> body address, while alive
        self._recorded: Dict[int, set] = {}  # body address -> streams record_stream named
        self.device_threads = DeviceThreads(self)

    @property
    def late_us(self) -> int:
        return self._late_us

    @late_us.setter
    def late_us(self, us: int) -> None:
        self._late_us = us
        self.sim.lib.simgpu_set_late_us(us)

    def current(self, device: int) -> int:
        return self.sim.lib.simgpu_current_stream(device) or 0

    def snapshot(self) -> Dict[int, int]:
        return {d: s for d in range(MAX_DEVICES) if (s := self.current(d))}

    @contextlib.contextmanager
    def use(self, snapshot: Dict[int, int]) -> Iterator[None]:
        saved = [self.current(d) for d in range(MAX_DEVICES)]
        for d, s in snapshot.items():
            assert self.sim.lib.simgpu_set_current_stream(d, s) == 0
        try:
            yield
        finally:
            for d, s in enumerate(saved):
                self.sim.lib.simgpu_set_current_stream(d, s)

    stream = use  # `with streams.stream({0: s})`, like torch.cuda.stream(s)

    def side_stream(self, device: int) -> int:
        """TorchStreams.side_stream: a stream of the test's own."""
        return self.sim.stream(device)

    @contextlib.contextmanager
    def on(self, device: int, handle: int) -> Iterator[None]:
        """TorchStreams.on: torch ops in the block queue on `handle`. Host
        tensors are written at once, so the block starts with the stream
        drained (a harness wait): the ops see what the stream held before
        them, as they would on a GPU, and nothing it did not."""
        with self.use({device: handle}):
            self.before_host_write(device)
            yield

    def before_host_write(self, device: int) -> None:
        code = self.sim.lib.simgpu_before_host_write(device)
        if code == 700:  # as torch reports a dead context
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        assert code == 0, code

    def hot_source(self) -> Tuple[int, int, int]:
        """The C entry points pyddp._hot's GPU hooks call for current(),
        before_host_write() and produced() (see pyddp/engine/streams.py)."""
        lib = self.sim.lib
        names = ("simgpu_current_stream", "simgpu_before_host_write", "simgpu_produced")
        return tuple(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names)

    def set_device(self, device: int) -> None:
        """This thread's current device (torch.cuda.set_device): its context."""
        self.sim.use_device(device)

    def autograd_backward(self, devices, modules, fns) -> None:
        """Runs replica r's backward fns[r] as autograd runs it on GPU
        devices[r] (device_threads.py): pyddp's wrapped model calls this
        where torch would run the replicas' backwards on the calling thread."""
        self.device_threads.run(devices, modules, fns)

    def capturing(self, device: int) -> bool:
        """Whether the current stream of `device` captures a graph (torch:
        torch.cuda.is_current_stream_capturing())."""
        status = ctypes.c_int()
        with self.sim.on_device(device):
            code = self.sim.lib.cuStreamGetCaptureInfo_v2(
                self.current(device), ctypes.byref(status), None, None, None, None
            )
        assert code == 0, code
        return status.value != 0

    def produced(self, device: int, tensor) -> None:
        if self.late_us <= 0 or not tensor.is_floating_point() or not tensor.numel():
            return
        nbytes = tensor.numel() * tensor.element_size()
        lib = self.sim.lib
        assert lib.simgpu_produced(device, self.current(device), tensor.data_ptr(), nbytes) == 0

    GUARD_BYTES = 256

    def zeros(self, count: int, dtype, device: int):
        """Device memory of `device`, allocated on its current stream, with
        guard zones before and after (canary bytes the simulation checks
        after every kernel and collective). Every buffer a collective or a
        kernel touches must come from here: the simulation refuses memory of
        another device or of no device.

        Freed as torch's caching allocator frees a block: when its storage
        dies (the last view with it), back to the allocation stream's pool.
        The simulation then checks that every other stream's use was ordered
        before that stream's next allocation could reuse it (see retire());
        the host memory itself is kept until that check passed, so a late
        write never lands in memory Python gave back."""
        import torch

        es = torch.empty((), dtype=dtype).element_size()
        guard = -(-self.GUARD_BYTES // es)
        nbytes = (count + 2 * guard) * es
        memory = (ctypes.c_double * (-(-nbytes // 8) or 1))()
        address = ctypes.addressof(memory)
        # The tensor's storage holds `holder` (torch.frombuffer keeps its
        # buffer alive): its finalizer runs when the storage dies.
        holder = (ctypes.c_char * max(nbytes, 1)).from_address(address)
        base = torch.frombuffer(holder, dtype=torch.uint8, count=nbytes).view(dtype)
        base.zero_()
        body = base[guard : guard + count]
        lead = guard * es
        stream = self.current(device)
        lib = self.sim.lib
        assert lib.simgpu_alloc(address, lead, count * es, lead, device, stream) == 0
        body_ptr = address + lead
        with self._lock:
            self._memory[body_ptr] = memory
            self._blocks[address] = body_ptr
        finalizer = weakref.finalize(holder, self._free, address, body_ptr)
        finalizer.atexit = False  # at exit nothing is freed: no check to run
        self._release()
        return body

    def retire(self, tensors, device: int) -> None:
        """Tensor.record_stream(current stream of `device`) for each of
        `tensors`: their blocks are not reused before that stream passes the
        point where they are freed."""
        stream = self.current(device)
        for t in tensors:
            self.record_stream(t, stream)

    def record_stream(self, tensor, stream: int) -> None:
        """Tensor.record_stream(stream) for the simulated caching allocator."""
        with self._lock:
            body = self._blocks.get(tensor.untyped_storage().data_ptr())
            if body is not None:
                self._recorded.setdefault(body, set()).add(stream)

    def _free(self, address: int, body_ptr: int) -> None:
        with self._lock:
            self._blocks.pop(address, None)
            streams = sorted(self._recorded.pop(body_ptr, ()))
        handles = (ctypes.c_void_p * max(len(streams), 1))(*streams)
        self.sim.lib.simgpu_free(body_ptr, handles, len(streams))

    def _release(self) -> None:
        """Gives back the host memory of blocks whose free was found safe."""
        out = (ctypes.c_size_t * 64)()
        while True:
            n = self.sim.lib.simgpu_releasable(out, len(out))
            with self._lock:
                for body_ptr in out[:n]:
                    self._memory.pop(body_ptr, None)
            if n < len(out):
                return

    def upload(self, device: int, host):
        """A copy of `host` in memory of `device` (written on its current
        stream, like the pinned copy torch queues there)."""
        out = self.zeros(host.numel(), host.dtype, device).view(host.shape)
        out.copy_(host)
        return out

    def timing_event(self, device: int):
        """An event (timing on) recorded on the current stream of `device`."""
        lib = self.sim.lib
        event = ctypes.c_void_p()
        with self.sim.on_device(device):
            _raise_as_torch(lib.cuEventCreate(ctypes.byref(event), 0))
            token = SimEvent(event.value)
            weakref.finalize(token, lib.cuEventDestroy_v2, event.value)
            _raise_as_torch(lib.cuEventRecord(event, self.current(device)))
        return token

    def event_done(self, event) -> bool:
        code = self.sim.lib.cuEventQuery(event.handle)
        if code != 600:  # CUDA_ERROR_NOT_READY
            _raise_as_torch(code)
        return code == 0

    def elapsed_ms(self, start, end) -> float:
        ms = ctypes.c_float()
        _raise_as_torch(self.sim.lib.cuEventElapsedTime(ctypes.byref(ms), start.handle, end.handle))
        return ms.value

    def fetch(self, device: int, tensor):
        """An event on the current stream stands for the copy to the host:
        the values are read once the stream passed it."""
        lib = self.sim.lib
        event = ctypes.c_void_p()
        with self.sim.on_device(device):
            assert lib.cuEventCreate(ctypes.byref(event), 0) == 0
            assert lib.cuEventRecord(event, self.current(device)) == 0
        out = tensor  # read only after the event
        handle = event.value

        def query() -> bool:
            code = lib.cuEventQuery(handle)
            assert code in (0, 600), code  # CUDA_SUCCESS, CUDA_ERROR_NOT_READY
            return code == 0

        def synchronize() -> None:
            assert lib.cuEventSynchronize(handle) == 0

        copy = SimHostCopy(out, query, synchronize)
        weakref.finalize(copy, lib.cuEventDestroy_v2, handle)
        return copy

    def synchronize_all(self, devices) -> None:
        """The test's torch.cuda.synchronize(): the host waits for the
        current streams (pyddp's own code never calls this)."""
        for d in set(devices):
            stream = self.current(d)
            self._drain(stream, d)
            assert self.sim.lib.simgpu_host_synchronized(d, stream) == 0

    def _drain(self, stream: int, device: int) -> None:
        with self.sim.on_device(device), self.sim.harness():
            code = self.sim.lib.cuStreamSynchronize(stream)
        if code == 700:  # as torch reports a dead context
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        assert code == 0, code


def _raise_as_torch(code: int) -> None:
    """A failed driver call as torch's CUDA calls raise it."""
    if code:
        raise RuntimeError(f"CUDA error {code} (simulated driver)")


class SimEvent:
    """A simulated CUDA event's handle, destroyed with this object."""

    def __init__(self, handle: int):
        self.handle = handle


class SimHostCopy:
    """pyddp's HostCopy protocol (ready(), get()) on a simulated event. get()
    waits (a counted host wait) unless an earlier ready() saw the values
    arrive: whether they happened to be there already when pyddp demanded
    them is timing, and the tests count what pyddp demands, so that the
    count is the same on a loaded machine."""

    def __init__(self, out, query, synchronize):
        self._out, self._query, self._synchronize = out, query, synchronize
        self._done = False

    def ready(self) -> bool:
        self._done = self._done or bool(self._query())
        return self._done

    def get(self):
        if not self._done:
            self._synchronize()
            self._done = True
        return self._out


class HostReads:
    """Counts the host's reads of tensor values made from pyddp's code while
    inside (item(), float(), bool(), tolist(), torch.equal, .cpu() ...), on
    every thread: on a GPU each one waits for the device. Given the
    simulation, only reads of its device memory count (else every tensor);
    never in _link/agreement.py, which reads only host copies (their
    arrival is a driver wait the simulation counts as "host_sync"; here the
    copy is the device memory itself)."""

    METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu")
    FUNCTIONS = ("equal", "allclose")
    HOST_SIDE = (os.path.join("_link", "agreement.py"),)

    def __init__(self, sim: Sim | None = None):
        self.sim = sim
        self.reads = []
        self._lock = threading.Lock()
        self._saved = []

    def _wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)
        import pyddp

        # Where pyddp's modules load from: an installed build where there is
        # one (pyddp/_source_tree.py), not necessarily this checkout.
        pkgs = tuple(os.path.abspath(p) + os.sep for p in pyddp.__path__)
        torch_dir = os.sep + "torch" + os.sep

        def counted(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and torch_dir in frame.f_code.co_filename:
                frame = frame.f_back
            path = "" if frame is None else frame.f_code.co_filename
            pkg = next((p for p in pkgs if path.startswith(p)), None)
            if pkg and not path.endswith(self.HOST_SIDE) and self._on_device(args):
                with self._lock:
                    self.reads.append(f"{path[len(pkg) :]}:{frame.f_lineno} {name}")
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def _on_device(self, args) -> bool:
        import torch

        if self.sim is None:
            return True
        device = self.sim.lib.simgpu_is_device
        return any(isinstance(a, torch.Tensor) and a.numel() and device(a.data_ptr()) for a in args)

    def __enter__(self):
        import torch

        for name in self.METHODS:
            self._wrap(torch.Tensor, name)
        for name in self.FUNCTIONS:
            self._wrap(torch, name)
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
