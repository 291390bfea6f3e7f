"""`python -m pyddp.doctor`: what pyddp found on this machine (NCCL, CUDA
driver, devices, which backend each device pair would use) and why a GPU
feature is unavailable. Runs anywhere, GPU or not."""

from __future__ import annotations

import platform
import sys
from typing import List

import torch

from . import _C, __version__
from ._runtime import NCCL_ENV, cuda_driver, find_nccl, timeout_s


def report() -> List[str]:
    lines = [
        f"pyddp {__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}",
        f"cpu backend: in-process, {_C.CpuBackend().threads} reduction threads",
    ]
    driver, count, why = cuda_driver()
    if driver is None:
        lines.append(f"cuda driver: not available ({why})")
    else:
        lines.append(f"cuda driver: {driver}, {count} device(s)")
        for i in range(count):
            lines.append(f"  cuda:{i}: {_C.cuda_device_name(i)}")
    try:
        nccl = find_nccl()
    except RuntimeError as e:
        lines.append(f"nccl: error: {e}")
        nccl = None
    if nccl is not None and nccl.path:
        lines.append(f"nccl: {nccl.version} from {nccl.path}")
    elif nccl is not None:
        lines.append(f"nccl: not found (set {NCCL_ENV}, or pip install pyddp[cuda12]); tried:")
        lines += [f"  {t}" for t in nccl.tried]
    kernel = _C.device_kernel_available()
    lines.append(
        "on-device kernel (replicas sharing a GPU): "
        + ("built in" if kernel else "not built (no nvcc when pyddp was built)")
    )
    lines.append(f"collective timeout: {timeout_s():g} s")
    lines.append("backends by replica placement:")
    lines.append("  cpu, cpu, ...          -> cpu (in-process)")
    gpu_ok = driver is not None and count > 0
    pairs = "nccl" if gpu_ok and nccl is not None and nccl.path else "unavailable"
    if pairs == "unavailable":
        pairs += " (" + ("no NCCL" if gpu_ok else "no GPU") + ")"
    if gpu_ok and count < 2:
        pairs += f" (this machine has {count} GPU)"
    same = "device kernel" if gpu_ok and kernel else "unavailable"
    if same == "unavailable":
        same += " (" + ("no GPU" if not gpu_ok else "kernel not built") + ")"
    lines.append(f"  cuda:i, cuda:j (i!=j) -> {pairs}")
    lines.append(f"  cuda:i, cuda:i        -> {same}")
    lines.append("  cpu, cuda:i            -> unsupported (all replicas on CPU or all on GPU)")
    return lines


def main() -> int:
    print("\n".join(report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
