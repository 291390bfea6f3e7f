"""What the GPU path can use on this machine, discovered at run time: the NCCL
library (PYDDP_NCCL_LIBRARY, else the nvidia-nccl-cu13/-cu12 wheel, else
torch's, else the system's), the CUDA driver, and which backend a set of
replica devices gets. Nothing here needs a GPU to import or to answer."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from . import _C

NCCL_ENV = "PYDDP_NCCL_LIBRARY"
TIMEOUT_ENV = "PYDDP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


@dataclass
class NcclInfo:
    path: Optional[str]
    version: Optional[str]
    tried: List[str] = field(default_factory=list)  # "where: why not"


def nccl_candidates() -> List[str]:
    """Where NCCL may be, in the order pyddp tries them (env var excluded)."""
    found: List[str] = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels

        for root in nvidia.__path__:
            # cu12 wheels: nvidia/nccl/lib; cu13 wheels may nest per CUDA version.
            found += sorted(glob.glob(os.path.join(root, "*", "lib", "libnccl.so.2")))
            found += sorted(glob.glob(os.path.join(root, "*", "*", "lib", "libnccl.so.2")))
    except ImportError:
        pass
    found.append(os.path.join(os.path.dirname(torch.__file__), "lib", "libnccl.so.2"))
    found.append("libnccl.so.2")  # the system's, through the dynamic loader's search path
    seen, out = set(), []
    for p in found:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def _version(code: int) -> str:
    major, rest = divmod(code, 10000)
    return f"{major}.{rest // 100}.{rest % 100}"


def find_nccl() -> NcclInfo:
    """Loads the first NCCL that works. An explicit PYDDP_NCCL_LIBRARY that does
    not load is an error, not a reason to pick another library silently."""
    explicit = os.environ.get(NCCL_ENV)
    if explicit:
        try:
            return NcclInfo(explicit, _version(_C.nccl_version(explicit)))
        except RuntimeError as e:
            raise RuntimeError(
                f"{NCCL_ENV}={explicit!r} could not be loaded: {e}. Point it at a "
                f"libnccl.so.2, or unset it to let pyddp search ({', '.join(nccl_candidates())})"
            ) from None
    info = NcclInfo(None, None)
    for path in nccl_candidates():
        if os.sep in path and not os.path.exists(path):
            info.tried.append(f"{path}: not there")
            continue
        try:
            return NcclInfo(path, _version(_C.nccl_version(path)), info.tried)
        except RuntimeError as e:
            info.tried.append(f"{path}: {e}")
    return info


def cuda_driver() -> tuple:
    """(driver version string or None, number of devices, why unavailable)."""
    try:
        v = _C.cuda_driver_version()
        return f"{v // 1000}.{(v % 1000) // 10}", _C.cuda_device_count(), ""
    except RuntimeError as e:
        return None, 0, str(e)


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be > 0")
    return value


def backend_kind(devices: Sequence[torch.device]) -> str:
    """'cpu', 'nccl' (one replica per GPU) or 'device' (replicas share one GPU)."""
    types = {d.type for d in devices}
    if types == {"cpu"}:
        return "cpu"
    if types != {"cuda"}:
        raise ValueError(
            f"devices mix {sorted(types)}: replicas must all be on CPU or all on CUDA GPUs"
        )
    indices = [d.index for d in devices]
    if len(set(indices)) == len(indices):
        return "nccl"
    if len(set(indices)) == 1:
        return "device"
    raise ValueError(
        f"devices {[str(d) for d in devices]}: several GPUs with several replicas on some of "
        "them is not supported yet; use one replica per GPU, or replicas on one GPU"
    )


def make_backend(devices: Sequence[torch.device], timeout: Optional[float] = None):
    """The engine backend for these replica devices, or a clear error saying
    what is missing."""
    kind = backend_kind(devices)
    if kind == "cpu":
        return _C.CpuBackend()
    timeout = timeout_s() if timeout is None else timeout
    if kind == "device":
        if not _C.device_kernel_available():
            raise RuntimeError(
                "replicas sharing one GPU need pyddp's reduction kernel, and this build has "
                "none (nvcc was not found when pyddp was built); reinstall with nvcc on PATH"
            )
        return _C.DeviceBackend(devices[0].index, len(devices), timeout)
    nccl = find_nccl()
    if nccl.path is None:
        raise RuntimeError(
            "one replica per GPU needs NCCL, and none was found. Install it with "
            "`pip install pyddp[cuda12]` or `[cuda13]`, or set "
            f"{NCCL_ENV}. Tried: " + "; ".join(nccl.tried)
        )
    return _C.NcclBackend([d.index for d in devices], nccl.path, timeout)
