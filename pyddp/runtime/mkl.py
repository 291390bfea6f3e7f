"""oneMKL's vector math (VML) before replica threads first use it. torch calls
VML for float unary ops on CPUs (tanh, exp, sqrt, ...; the list below is
torch's `aten/src/ATen/cpu/vml.h`), asking for its high-accuracy kernels.
oneMKL resolves each function's kernel on that function's first call in the
process, and on oneMKL 2024.2 (torch's CPU wheels) first calls made at once
on several threads can run a low-accuracy kernel for one thread's call
(pytorch/pytorch#188792: the AVX2 "EP" kernel; tanh up to 4e-5 off). A
fresh process's first step on several replica threads makes exactly such
calls (as do torch's intra-op threads splitting a sizable op): one replica
would compute its rows of that step differently from the others and from one
device, at random. `warm()` makes every first call once, on the calling
thread, at `wrap` and `GradSync` (engine/params.py assemble), before any replica runs; torch's fix
(#188791) does the same inside torch."""

from __future__ import annotations

import threading

import torch

# torch's ops whose float32/float64 CPU kernels call VML (vml.h's
# IMPLEMENT_VML_MKL list; tests/test_workers.py checks it against the
# installed torch's header).
VML_OPS = (
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "log",
    "log10",
    "log2",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)

_lock = threading.Lock()
_warm = False


def warm() -> bool:
    """Makes each VML function's first call in this process, in both
    precisions, on this thread (once per process; later calls return at
    once). Returns whether it ran now. Nothing to do where torch has no MKL."""
    global _warm
    if _warm:
        return False
    with _lock:
        if _warm:
            return False
        if torch.backends.mkl.is_available():
            with torch.no_grad():
                for dtype in (torch.float32, torch.float64):
                    # Several vectors' worth, contiguous: the path torch's
                    # kernels take to VML; 0.5 is in every op's domain.
                    x = torch.full((64,), 0.5, dtype=dtype, device="cpu")
                    for op in VML_OPS:
                        getattr(torch, op)(x)
        _warm = True
        return True
