# Type stub of the compiled engine (csrc/bindings.cpp), generated with
# `pybind11-stubgen pyddp._C` and kept in step by tests/test_engine.py.
"""
pyddp engine (private; use the pyddp package)
"""

from __future__ import annotations

import collections.abc
import typing

__all__: list[str] = [
    "Backend",
    "CpuBackend",
    "Engine",
    "NcclBackend",
    "ProcessGroupBackend",
    "ReduceError",
    "SharedGpuBackend",
    "UsageError",
    "bench_mark_ready",
    "cuda_compute_capability",
    "cuda_device_count",
    "cuda_device_name",
    "cuda_driver_library",
    "cuda_driver_simulated",
    "cuda_driver_version",
    "load_device_kernel",
    "nccl_loaded_path",
    "nccl_unique_id",
    "nccl_version",
    "now_ns",
    "nvrtc_version",
    "plan_buckets",
    "stress_engine",
]

class UsageError(RuntimeError):
    pass

class ReduceError(RuntimeError):
    pass

class Backend:
    def all_gather(
        self,
        sends: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        recvs: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        devices: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        streams: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        count: typing.SupportsInt | typing.SupportsIndex,
        dtype: str,
    ) -> None:
        """
        One stream-ordered all-gather: `count` elements from every rank into each receive buffer (ranks * count elements, in rank order).
        """
    def broadcast(
        self,
        ptrs: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        devices: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        streams: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        count: typing.SupportsInt | typing.SupportsIndex,
        dtype: str,
        root: typing.SupportsInt | typing.SupportsIndex,
    ) -> None:
        """
        One stream-ordered in-place broadcast from rank `root` (see rank_of).
        """
    def check(self) -> None:
        """
        Raises ReduceError if a reduction failed or timed out.
        """
    def close(self) -> None:
        """
        Releases threads and communicators now; later use raises.
        """
    def rank_of(self, replica: typing.SupportsInt | typing.SupportsIndex) -> int:
        """
        Replica's rank among them (blocks and broadcast roots are by rank).
        """
    def ranks(self, replicas: typing.SupportsInt | typing.SupportsIndex) -> int:
        """
        How many ranks the collectives span, for `replicas` buffers from this process.
        """
    def reduce(
        self,
        ptrs: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        devices: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        streams: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        count: typing.SupportsInt | typing.SupportsIndex,
        dtype: str,
        op: str = "sum",
    ) -> None:
        """
        One stream-ordered in-place all-reduce outside the engine (collectives API).
        """
    def reduce_scatter(
        self,
        sends: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        recvs: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        devices: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        streams: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        count: typing.SupportsInt | typing.SupportsIndex,
        dtype: str,
        op: str = "sum",
    ) -> None:
        """
        One stream-ordered reduce-scatter: each receive buffer gets `count` elements, the reduction of its rank's block of every send buffer (ranks * count elements).
        """
    @property
    def captured_launches(self) -> int:
        """
        Launches made into a CUDA graph capture (they run at each replay).
        """
    @property
    def name(self) -> str: ...

class CpuBackend(Backend):
    def __init__(self, threads: typing.SupportsInt | typing.SupportsIndex = 0) -> None: ...
    @property
    def threads(self) -> int: ...

class NcclBackend(Backend):
    def __init__(
        self,
        devices: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        nccl_path: str,
        timeout_s: typing.SupportsFloat | typing.SupportsIndex,
        id: bytes = b"",
        nranks: typing.SupportsInt | typing.SupportsIndex = 0,
        first_rank: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None:
        """
        One replica per GPU. With `id` (nccl_unique_id() from one process, given to all): one communicator across processes, this process's GPUs being ranks first_rank.. of nranks.
        """
    def set_compression(self, dtype: str, nvrtc_path: str) -> None:
        """
        Wire compression of float32 buckets ('float16' or 'bfloat16'; 'float32': none), as torch DDP's fp16/bf16 compression hooks: each buffer's `wire` holds the 16-bit copy NCCL reduces. The kernels are compiled with NVRTC.
        """
    def set_hook(
        self,
        hook: collections.abc.Callable[[typing.SupportsInt | typing.SupportsIndex], None],
        stream: typing.SupportsInt | typing.SupportsIndex,
    ) -> None:
        """
        A communication hook outside the core, run on `stream` (a CUstream of the caller's): each bucket's all-reduce makes `stream` wait for the bucket's ready events, calls hook(bucket) on the engine's launcher thread, whose work must be queued on `stream` when it returns, then orders the communication stream after `stream`. One GPU per process.
        """
    @property
    def compression(self) -> str: ...

class SharedGpuBackend(Backend):
    def __init__(
        self,
        device: typing.SupportsInt | typing.SupportsIndex,
        replicas: typing.SupportsInt | typing.SupportsIndex,
        timeout_s: typing.SupportsFloat | typing.SupportsIndex,
        nvrtc_path: str,
    ) -> None: ...
    @property
    def kernel(self) -> str: ...

class ProcessGroupBackend(Backend):
    def __init__(
        self,
        local: Backend,
        launch: collections.abc.Callable,
        name: str,
        first_rank: typing.SupportsInt | typing.SupportsIndex,
        nranks: typing.SupportsInt | typing.SupportsIndex,
        hot: typing.Any = None,
    ) -> None:
        """
        Local reduction, then launch(bucket) starts the cross-process one (hot: from C++ where pyddp._hot's Wire can, else Python).
        """

class Engine:
    def __init__(
        self,
        num_replicas: typing.SupportsInt | typing.SupportsIndex,
        names: collections.abc.Sequence[str],
        numels: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        dtypes: collections.abc.Sequence[str],
        buckets: collections.abc.Sequence[
            collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
        ],
        order: str,
        op: str,
        backend: Backend,
    ) -> None: ...
    def abort(self) -> None: ...
    def check(self) -> None: ...
    def clear_grads(self, set_to_none: bool) -> None: ...
    def close(self) -> None: ...
    def finish(
        self, streams: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] = []
    ) -> tuple[list[int], list[int]]: ...
    def has_grad(self, param: typing.SupportsInt | typing.SupportsIndex) -> bool: ...
    def holds_reduced_copy(self, replica: typing.SupportsInt | typing.SupportsIndex) -> bool: ...
    def inject_fault(
        self, bucket: typing.SupportsInt | typing.SupportsIndex, message: str
    ) -> None: ...
    def hot_entry(self) -> tuple: ...
    def last_stats(self) -> dict: ...
    def last_timeline(self) -> dict: ...
    def mark_ready(
        self,
        replica: typing.SupportsInt | typing.SupportsIndex,
        param: typing.SupportsInt | typing.SupportsIndex,
        stream: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None: ...
    def note_forward_end(self) -> None: ...
    def note_grad(
        self, param: typing.SupportsInt | typing.SupportsIndex, has_grad: bool
    ) -> None: ...
    def padded_count(self, bucket: typing.SupportsInt | typing.SupportsIndex) -> int: ...
    def ready_order(self) -> list[int]: ...
    def release_buffer(
        self,
        replica: typing.SupportsInt | typing.SupportsIndex,
        bucket: typing.SupportsInt | typing.SupportsIndex,
    ) -> None:
        """
        Sharded gradients: the bucket's buffer was freed (launching it again raises).
        """
    def restore_reduced_copy(
        self, replica: typing.SupportsInt | typing.SupportsIndex, held: bool
    ) -> None: ...
    def set_buckets(
        self,
        buckets: collections.abc.Sequence[
            collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
        ],
    ) -> None: ...
    def set_buffer(
        self,
        replica: typing.SupportsInt | typing.SupportsIndex,
        bucket: typing.SupportsInt | typing.SupportsIndex,
        ptr: typing.SupportsInt | typing.SupportsIndex,
        count: typing.SupportsInt | typing.SupportsIndex,
        dtype: str,
        device: typing.SupportsInt | typing.SupportsIndex = -1,
        wire: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> None: ...
    def set_scatter(self, ranks: typing.SupportsInt | typing.SupportsIndex) -> None:
        """
        Sharded gradients: buckets reduce-scatter over `ranks` ranks (0: all-reduce); buffers hold padded_count(bucket) elements.
        """
    def set_sync(self, enabled: bool) -> None: ...
    def set_timeline(self, enabled: bool) -> None: ...
    def set_recv(
        self,
        replica: typing.SupportsInt | typing.SupportsIndex,
        bucket: typing.SupportsInt | typing.SupportsIndex,
        recv: typing.SupportsInt | typing.SupportsIndex,
    ) -> None:
        """
        Sharded gradients: the replica's block of the bucket lands at `recv` (0: in place).
        """
    def take_completed(self) -> list[int]:
        """
        Buckets whose reduction call returned since the last call (CPU: reduced).
        """
    def take_reduced_copy(self, replica: typing.SupportsInt | typing.SupportsIndex) -> bool: ...
    def unmarked(self) -> list[tuple[int, int]]: ...
    def learn_counts(self) -> None:
        """
        static_graph: the next synced backward counts each gradient's arrivals
        """
    @property
    def learning(self) -> bool: ...
    @property
    def expected_counts(self) -> list[int]:
        """
        Arrivals that make each gradient ready, [replica * P + param]
        """
    def use_stream(
        self,
        replica: typing.SupportsInt | typing.SupportsIndex,
        stream: typing.SupportsInt | typing.SupportsIndex,
    ) -> None: ...
    @property
    def active(self) -> bool: ...
    @property
    def backend_name(self) -> str: ...
    @property
    def buckets(self) -> list[list[int]]: ...
    @property
    def num_params(self) -> int: ...
    @property
    def num_replicas(self) -> int: ...
    @property
    def partial(self) -> bool: ...
    @property
    def failed(self) -> bool: ...
    def clear_failed(self) -> None: ...
    @property
    def partial_reason(self) -> str: ...
    @property
    def scatter_ranks(self) -> int: ...
    @property
    def inline_launches(self) -> int: ...
    @property
    def sync_enabled(self) -> bool: ...

def bench_mark_ready(
    replicas: typing.SupportsInt | typing.SupportsIndex,
    params: typing.SupportsInt | typing.SupportsIndex,
    iterations: typing.SupportsInt | typing.SupportsIndex,
) -> float: ...
def cuda_compute_capability(device: typing.SupportsInt | typing.SupportsIndex) -> int: ...
def cuda_capture_supported() -> bool:
    """
    Whether the CUDA driver has what a captured step uses (capture info, capture modes).
    """

def cuda_device_count() -> int: ...
def cuda_device_name(device: typing.SupportsInt | typing.SupportsIndex) -> str: ...
def cuda_driver_library() -> str: ...
def cuda_driver_simulated() -> bool: ...
def cuda_driver_version() -> int: ...
def load_device_kernel(device: typing.SupportsInt | typing.SupportsIndex, nvrtc_path: str) -> str:
    """
    Compiles (NVRTC) and loads (cuModuleLoadData) the reduction kernel on a device; returns what was built.
    """

def nccl_loaded_path() -> str: ...
def nccl_unique_id(nccl_path: str) -> bytes:
    """
    ncclGetUniqueId, as bytes to pass to the other processes.
    """

def nccl_version(path: str) -> int: ...
def now_ns() -> int:
    """
    Steady-clock time in nanoseconds (the engine's stats clock).
    """

def nvrtc_version(path: str) -> str: ...
def plan_buckets(
    numels: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
    dtypes: collections.abc.Sequence[str],
    order: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
    first_cap_bytes: typing.SupportsInt | typing.SupportsIndex,
    cap_bytes: typing.SupportsInt | typing.SupportsIndex,
    taper: bool = False,
) -> list[list[int]]: ...
def stress_engine(
    replicas: typing.SupportsInt | typing.SupportsIndex,
    params: typing.SupportsInt | typing.SupportsIndex,
    cap_bytes: typing.SupportsInt | typing.SupportsIndex,
    index_order: bool,
    iterations: typing.SupportsInt | typing.SupportsIndex,
    threads: typing.SupportsInt | typing.SupportsIndex,
    seed: typing.SupportsInt | typing.SupportsIndex,
    skip_fraction: typing.SupportsFloat | typing.SupportsIndex,
) -> dict: ...
