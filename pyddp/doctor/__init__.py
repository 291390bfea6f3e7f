"""`python -m pyddp.doctor`: what pyddp found on this machine (CUDA driver,
NCCL, NVRTC, devices, the shared-GPU kernel actually compiled and loaded on
each GPU, which backend each placement gets) and why a GPU feature is
unavailable. Runs anywhere, GPU or not. `--selftest` runs the GPU checks of
pyddp.doctor.selftest on this machine's GPUs (the first thing to run on real GPUs)."""

from __future__ import annotations

import argparse
import os
import platform
from typing import List, Optional

import torch

from .. import _C, __version__
from ..engine.observe import timeline_from_env
from ..runtime.libraries import (
    CUDA_ENV,
    NCCL_ENV,
    NVRTC_ENV,
    cuda_driver,
    find_nccl,
    find_nvrtc,
    hot_status,
    timeout_s,
)


def report(problems: Optional[List[str]] = None) -> List[str]:
    """The doctor's lines; what pyddp would refuse, or a library named in
    the environment that does not load, also into `problems`."""
    problems = [] if problems is None else problems
    lines = [
        f"pyddp {__version__}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}",
        f"cpu backend: in-process, {_C.CpuBackend().threads} reduction threads",
    ]
    driver, count, why = cuda_driver()
    if driver is None:
        lines.append(f"cuda driver: not available ({why})")
        if os.environ.get(CUDA_ENV):  # (named, and it does not load)
            problems.append(f"{CUDA_ENV}={os.environ[CUDA_ENV]!r}: {why}")
    else:
        simulated = _C.cuda_driver_simulated()
        lines.append(
            f"cuda driver: {driver}, {count} device(s), from {_C.cuda_driver_library()}"
            + ("  ** SIMULATED (pyddp's test double, not a GPU) **" if simulated else "")
        )
        for i in range(count):
            cc = _C.cuda_compute_capability(i)
            lines.append(f"  cuda:{i}: {_C.cuda_device_name(i)} (sm_{cc})")
    nccl = _library_line(
        lines, problems, "nccl", find_nccl, NCCL_ENV, 'pip install ".[cuda12]" (from the clone)'
    )
    nvrtc = _library_line(
        lines, problems, "nvrtc", find_nvrtc, NVRTC_ENV, "pip install nvidia-cuda-nvrtc-cu12"
    )
    kernel_ok = False
    if driver is not None and count > 0 and nvrtc is not None and nvrtc.path:
        for i in range(count):
            try:
                how = _C.load_device_kernel(i, nvrtc.path)
                lines.append(f"on-device kernel on cuda:{i}: loaded ({how})")
                kernel_ok = True
            except RuntimeError as e:
                lines.append(f"on-device kernel on cuda:{i}: FAILED to compile or load: {e}")
    else:
        lines.append("on-device kernel (replicas sharing a GPU): not tried (no GPU or no NVRTC)")
    try:
        why = hot_status()[1]
    except ValueError as e:
        why = f"ERROR: {e} (wrap refuses it)"
        problems.append(str(e))
    lines.append(f"torch-linked hot path (C++ gradient hooks and cross-process launches): {why}")
    for what, read, unit in (("collective timeout", timeout_s, " s"),
                             ("timeline", timeline_from_env, " iterations kept")):  # fmt: skip
        try:
            lines.append(f"{what}: {read():g}{unit}")
        except ValueError as e:  # what wrap would refuse: said here, not raised
            lines.append(f"{what}: ERROR: {e} (wrap refuses it)")
            problems.append(str(e))
    lines.append("backends by replica placement:")
    lines.append("  cpu, cpu, ...          -> cpu (in-process)")
    gpu_ok = driver is not None and count > 0
    pairs = "nccl" if gpu_ok and nccl is not None and nccl.path else "unavailable"
    if pairs == "unavailable":
        pairs += " (" + ("no NCCL" if gpu_ok else "no GPU") + ")"
    if gpu_ok and count < 2:
        pairs += f" (this machine has {count} GPU)"
    same = "device kernel" if kernel_ok else "unavailable"
    if same == "unavailable":
        same += " (" + ("no GPU" if not gpu_ok else "kernel did not load, see above") + ")"
    lines.append(f"  cuda:i, cuda:j (i!=j) -> {pairs}")
    lines.append(f"  cuda:i, cuda:i        -> {same}")
    lines.append("  cpu, cuda:i            -> unsupported (all replicas on CPU or all on GPU)")
    return lines


def _library_line(lines: List[str], problems: List[str], name: str, find, env: str,
                  install: str):  # fmt: skip
    try:
        info = find()
    except RuntimeError as e:  # (the library its variable names does not load)
        lines.append(f"{name}: error: {e}")
        problems.append(str(e))
        return None
    if info.path:
        lines.append(f"{name}: {info.version} from {info.path}")
    else:
        lines.append(f"{name}: not found (set {env}, or {install}); tried:")
        lines += [f"  {t}" for t in info.tried] or ["  (nothing)"]
    return info


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pyddp.doctor",
        description="What pyddp found on this machine; --selftest checks the GPU path on it.",
    )
    parser.add_argument(
        "--selftest",
        action="store_true",
        help="run pyddp's GPU checks (equivalence, stream ordering, the four collectives, the "
        "sharded optimizer, timeout; NCCL's with 2+ GPUs) on this "
        "machine's GPUs, a minute or two, and print a pass/fail table",
    )
    args = parser.parse_args(argv)
    problems: List[str] = []
    print("\n".join(report(problems)))
    # A setting wrap refuses, or a library named in the environment that does
    # not load: a pre-flight check (`python -m pyddp.doctor && ...`) stops here.
    # (A hot path that did not build is no problem: the Python path runs.)
    if problems:
        print(f"doctor: {len(problems)} problem(s) above (exit status 1)")
    if args.selftest:
        from .selftest import run

        return run() or int(bool(problems))
    return int(bool(problems))
