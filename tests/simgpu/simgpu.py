"""Python side of the simulated CUDA driver (libsimgpu.so, see simgpu.cpp):
building it, a ctypes handle for the tests' controls, and SimStreams, the
stream provider that stands in for torch.cuda's current streams."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from typing import Dict, Iterator

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
        self.lib.simgpu_violations.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self.lib.simgpu_counter.argtypes = [ctypes.c_char_p]
        self.lib.simgpu_counter.restype = ctypes.c_long
        self.lib.cuStreamCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        self.lib.cuStreamSynchronize.argtypes = [vp]
        self.lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
        self.lib.cuCtxSetCurrent.argtypes = [vp]
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
        assert self.lib.cuStreamSynchronize(stream) == 0

    def violations(self) -> str:
        buf = ctypes.create_string_buffer(1 << 16)
        n = self.lib.simgpu_violations(buf, len(buf))
        return buf.value.decode() if n else ""

    def counter(self, name: str) -> int:
        return self.lib.simgpu_counter(name.encode())


class SimStreams:
    """pyddp's stream-provider protocol (see pyddp/_streams.py) on the
    simulated driver: thread-local current streams, 0 (the default stream)
    unless set with `stream()`. Host tensor writes stand in for kernels queued
    on the current stream, so before one the current stream is drained."""

    def __init__(self, sim: Sim):
        self.sim = sim
        self._local = threading.local()

    def _current(self) -> Dict[int, int]:
        if not hasattr(self._local, "streams"):
            self._local.streams = {}
        return self._local.streams

    def current(self, device: int) -> int:
        return self._current().get(device, 0)

    def snapshot(self) -> Dict[int, int]:
        return dict(self._current())

    @contextlib.contextmanager
    def use(self, snapshot: Dict[int, int]) -> Iterator[None]:
        saved = dict(self._current())
        self._current().update(snapshot)
        try:
            yield
        finally:
            self._local.streams = saved

    stream = use  # `with streams.stream({0: s})`, like torch.cuda.stream(s)

    def before_host_write(self, device: int) -> None:
        self.sim.synchronize(self.current(device), device)

    def synchronize_all(self, devices) -> None:
        for d in set(devices):
            self.sim.synchronize(self.current(d), d)
