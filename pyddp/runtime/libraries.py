"""What the GPU path can use on this machine, discovered at run time: the CUDA
driver (PYDDP_CUDA_LIBRARY, else libcuda.so.1), the NCCL library
(PYDDP_NCCL_LIBRARY, else the nvidia-nccl-cu13/-cu12 wheel, else torch's, else
the system's), NVRTC for the shared-GPU kernel (PYDDP_NVRTC_LIBRARY, else the
nvidia-cuda-nvrtc wheel torch's CUDA builds depend on, else the system's), and
which backend a set of replica devices gets. Nothing here needs a GPU to import
or to answer. Every GPU backend made here is closed at interpreter exit, before
the driver's own teardown."""

from __future__ import annotations

import atexit
import functools
import glob
import importlib
import os
import re
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

import torch

from .. import _C

CUDA_ENV = "PYDDP_CUDA_LIBRARY"  # read by the core (_C) itself
NCCL_ENV = "PYDDP_NCCL_LIBRARY"
NVRTC_ENV = "PYDDP_NVRTC_LIBRARY"
TIMEOUT_ENV = "PYDDP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
# The longest timeout accepted: a week. Longer (or inf) is a hang with extra
# steps, and past ~1e9 s the deadlines torch and the store compute overflow.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


# The dtypes the C++ backends reduce, by the names the bindings take.
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


@dataclass
class LibraryInfo:
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


def _find_library(
    env: str, candidates: List[str], version: Callable[[str], str], hint: str
) -> LibraryInfo:
    """Loads the first candidate that works. An explicit `env` that does not
    load is an error, not a reason to pick another library silently."""
    explicit = os.environ.get(env)
    if explicit:
        try:
            return LibraryInfo(explicit, version(explicit))
        except RuntimeError as e:
            raise RuntimeError(
                f"{env}={explicit!r} could not be loaded: {e}. Point it at a {hint}, or unset "
                f"it to let pyddp search ({', '.join(candidates)})"
            ) from None
    info = LibraryInfo(None, None)
    for path in candidates:
        if os.sep in path and not os.path.exists(path):
            info.tried.append(f"{path}: not there")
            continue
        try:
            return LibraryInfo(path, version(path), info.tried)
        except RuntimeError as e:
            info.tried.append(f"{path}: {e}")
    return info


def find_nccl() -> LibraryInfo:
    """The NCCL one replica per GPU reduces with."""
    return _find_library(
        NCCL_ENV, nccl_candidates(), lambda p: _version(_C.nccl_version(p)), "libnccl.so.2"
    )


def nvrtc_candidates(driver_major: Optional[int] = None) -> List[str]:
    """NVRTC libraries in the order pyddp tries them: the newest CUDA major
    version the driver runs first (a cubin from a newer NVRTC needs a newer
    driver), wheels before torch's and the system's."""
    found: List[str] = []
    try:
        import nvidia

        for root in nvidia.__path__:
            found += glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so.*"))
            found += glob.glob(os.path.join(root, "*", "*", "lib", "libnvrtc.so.*"))
    except ImportError:
        pass
    found += glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libnvrtc*.so*"))
    found = [p for p in found if re.search(r"libnvrtc(-[0-9a-f]+)?\.so\.\d+$", p)]
    found += ["libnvrtc.so.13", "libnvrtc.so.12"]

    def major(path: str) -> int:
        return int(path.rsplit(".", 1)[1])

    if driver_major is not None:
        found = [p for p in found if major(p) <= driver_major]
    seen, out = set(), []
    for p in sorted(found, key=lambda p: -major(p)):
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def find_nvrtc() -> LibraryInfo:
    """The NVRTC the shared-GPU kernel is compiled with."""
    driver, _, _ = cuda_driver()
    candidates = nvrtc_candidates(int(driver.split(".")[0]) if driver else None)
    return _find_library(NVRTC_ENV, candidates, _C.nvrtc_version, "libnvrtc.so.12 or .13")


def nvrtc_path(need: str) -> str:
    """NVRTC's path, or an error saying `need` and how to install it."""
    return _require(
        find_nvrtc(),
        need,
        "`pip install nvidia-cuda-nvrtc-cu12` (CUDA builds of torch bring it)",
        NVRTC_ENV,
    )


def _require(info: LibraryInfo, need: str, install: str, env: str) -> str:
    if info.path is None:
        raise RuntimeError(
            f"{need}, and none was found. Install it with {install}, or set {env}. Tried: "
            + "; ".join(info.tried)
        )
    return info.path


_live_backends: weakref.WeakSet[Any] = weakref.WeakSet()


HOT_ENV = "PYDDP_HOT"  # "0": the Python path, even where pyddp._hot was built
_SWITCH = {v: on for on, vs in ((False, ("0", "false", "off", "no")),
                                (True, ("1", "true", "on", "yes", ""))) for v in vs}  # fmt: skip


def hot_status() -> tuple:
    """(pyddp._hot or None, why not): the torch-linked hot path (C++
    gradient hooks), loaded only if this build made it for the running
    torch and PYDDP_HOT is not "0"."""
    raw = os.environ.get(HOT_ENV, "1").strip().lower()
    if raw not in _SWITCH:
        raise ValueError(
            f"{HOT_ENV}={os.environ[HOT_ENV]!r}: 0, false, off or no switch the hot path off; "
            "1, true, on or yes (or leaving it unset) keep it"
        )
    return _load_hot(_SWITCH[raw])


def hot() -> Optional[Any]:
    """pyddp._hot, or None; the first time it is missing for a reason the
    user can act on (built for another torch), says so once."""
    module, why = hot_status()
    if module is None and why.startswith(("built for torch", "not built: it failed")):
        _say_once(why)
    return module


@functools.cache
def _load_hot(enabled: bool) -> tuple:
    if not enabled:
        return None, f"switched off ({HOT_ENV}): Python gradient hooks and bucket launches"
    try:
        record = importlib.import_module("pyddp._hot_build")
    except ImportError:
        return None, (
            "not built (no torch at pyddp's build: install torch, then pyddp again): "
            "Python gradient hooks and bucket launches"
        )
    skipped = getattr(record, "SKIPPED", None)
    if skipped is not None:
        return None, (
            f"not built: left out at pyddp's build ({skipped}): Python gradient hooks and "
            "bucket launches"
        )
    built, failed = record.TORCH_VERSION, getattr(record, "FAILED", None)
    if failed is not None:
        last = [line for line in failed.strip().splitlines() if "error" in line.lower()]
        return None, (
            f"not built: it failed to compile against torch {built} at pyddp's build (so "
            "pyddp was installed without it): Python gradient hooks and bucket launches. "
            "Please report it with the compiler's output"
            + (f"; its first error: {last[0].strip()}" if last else "")
        )
    if built != torch.__version__:
        return None, (
            f"built for torch {built}, running torch {torch.__version__}: Python gradient "
            "hooks and bucket launches; reinstall pyddp to build it for this torch"
        )
    try:
        return importlib.import_module("pyddp._hot"), f"loaded (built for torch {built})"
    except ImportError as e:
        return None, f"failed to load ({e}): Python gradient hooks and bucket launches"


@functools.cache
def _say_once(why: str) -> None:
    warnings.warn(f"pyddp: the torch-linked hot path is {why}", RuntimeWarning, stacklevel=3)


@atexit.register
def close_all_backends() -> None:
    """Closes every GPU backend still alive: their watchdog threads must not
    poll the driver while the process tears it down."""
    for backend in list(_live_backends):
        backend.close()


def cuda_driver() -> tuple:
    """(driver version string or None, number of devices, why unavailable)."""
    try:
        v = _C.cuda_driver_version()
        return f"{v // 1000}.{(v % 1000) // 10}", _C.cuda_device_count(), ""
    except RuntimeError as e:
        return None, 0, str(e)


INIT_TIMEOUT_S: Optional[float] = None  # pyddp.init(timeout_s=...), if given

_RANGE = (
    f"give seconds > 0 and at most {MAX_TIMEOUT_S:.0f} (7 days; longer, or inf, "
    "would wait forever on a rank that never arrives), e.g. 300, the default"
)


def checked_timeout(value: Any, name: str) -> float:
    """`value` as seconds when it is a finite number in (0, MAX_TIMEOUT_S];
    else a ValueError naming `name` (the argument or the variable, with what
    was given) and the valid range. Every timeout pyddp accepts (wrap's,
    GradSync's, init's and $PYDDP_TIMEOUT_S) passes through here."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} is not a number of seconds: {_RANGE}")
    # Compared before float(): an int such as 10**400 has no float.
    if not 0 < value <= MAX_TIMEOUT_S:  # False for nan as well
        raise ValueError(f"{name} is out of range: {_RANGE}")
    return float(value)


def timeout_s() -> float:
    """The collective timeout: pyddp.init(timeout_s=...), else
    $PYDDP_TIMEOUT_S, else DEFAULT_TIMEOUT_S."""
    if INIT_TIMEOUT_S is not None:
        return INIT_TIMEOUT_S
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    name = f"{TIMEOUT_ENV}={raw!r}"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} is not a number of seconds: {_RANGE}") from None
    return checked_timeout(value, name)


def backend_kind(devices: Sequence[Any]) -> str:
    """'cpu', 'nccl' (one replica per GPU) or 'device' (replicas share one GPU).
    `devices` are torch devices, or CUDA device indices."""
    if all(isinstance(d, int) for d in devices):
        devices = [torch.device("cuda", d) for d in devices]
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


def process_group_backend(
    local: Any, launch: Any, first: int, total: int, wire: Optional[Any] = None
) -> Any:
    """The engine backend across processes on CPUs: `local` (this process's
    backend) sums the process's replicas in C++, then the launcher hands
    each summed bucket to `wire` (pyddp._hot's, in C++), or to `launch` (the
    link's transport) where there is none or it declines, with no reference
    to the link; this process's replicas are ranks first.. of `total`."""
    return _C.ProcessGroupBackend(local, launch, f"{local.name}+gloo", first, total, wire)


def make_backend(
    devices: Sequence[Any], timeout: Optional[float] = None, rendezvous: Optional[Any] = None
):
    """The engine backend for these replica devices (torch devices, or CUDA
    device indices), or a clear error saying what is missing. `rendezvous`
    (NCCL across processes) is a callable nccl_path -> (id, nranks, first_rank)."""
    kind = backend_kind(devices)
    if kind == "cpu":
        return _C.CpuBackend()
    indices = [d if isinstance(d, int) else d.index for d in devices]
    timeout = timeout_s() if timeout is None else timeout
    # No driver is the first thing to say: without one, a missing NCCL or
    # NVRTC is beside the point.
    driver, _, why = cuda_driver()
    if driver is None:
        raise RuntimeError(f"pyddp: {why}")
    if kind == "device":
        nvrtc = nvrtc_path("replicas sharing one GPU compile pyddp's reduction kernel with NVRTC")
        backend = _C.SharedGpuBackend(indices[0], len(indices), timeout, nvrtc)
    else:
        nccl = _require(
            find_nccl(),
            "one replica per GPU needs NCCL",
            '`pip install ".[cuda12]"` (or ".[cuda13]") from a clone of pyddp',
            NCCL_ENV,
        )
        if rendezvous is None:
            backend = _C.NcclBackend(indices, nccl, timeout)
        else:
            uid, nranks, first = rendezvous(nccl)
            backend = _C.NcclBackend(indices, nccl, timeout, uid, nranks, first)
    _live_backends.add(backend)
    return backend
