"""`pyddp-bench allreduce`: an nccl-tests-style table (size, count, dtype,
time, algbw, busbw = algbw * 2(n-1)/n) for pyddp.all_reduce over the chosen
devices, side by side with a reference measured in the same run: a plain
memory copy of the same bytes on CPU (a reduction reads and writes N buffers,
a copy one, so algbw / copy tends to 1/N at memory speed)."""

from __future__ import annotations

import time
from typing import Any, Dict, List

import torch
from tqdm.auto import tqdm

import pyddp

from ._util import summary

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def sizes(min_bytes: int, max_bytes: int, factor: int) -> List[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def run(
    devices: List[str], byte_sizes: List[int], dtype: str, reps: int, progress: bool = True
) -> List[Dict[str, Any]]:
    dt = DTYPES[dtype]
    n = len(devices)
    rows = []
    for size in tqdm(byte_sizes, desc="all-reduce sizes", disable=not progress, leave=False):
        count = max(1, size // torch.tensor([], dtype=dt).element_size())
        bufs = [torch.ones(count, dtype=dt, device=d) for d in devices]
        src, dst = torch.ones(count, dtype=dt), torch.empty(count, dtype=dt)
        calls = max(1, min(1000, (64 << 20) // max(size, 1)))  # ~64 MiB moved per sample
        ours, copy = [], []
        for _ in range(reps):  # interleaved: both see the same machine state
            ours.append(_time(lambda b=bufs: pyddp.all_reduce(b, op="avg"), calls, devices))
            copy.append(_time(lambda d=dst, s=src: d.copy_(s), calls, devices))
        t, c = summary(ours), summary(copy)
        nbytes = count * dst.element_size()
        algbw = nbytes / t["median"] / 1e9
        rows.append(
            {
                "bytes": nbytes,
                "count": count,
                "dtype": dtype,
                "replicas": n,
                "time_s": t,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * 2 * (n - 1) / n if n > 1 else 0,
                "copy_time_s": c,
                "copy_GBps": nbytes / c["median"] / 1e9,
                "algbw_over_copy": c["median"] / t["median"],
            }
        )
    return rows


def _time(fn, calls: int, devices: List[str]) -> float:
    cuda = any(d.startswith("cuda") for d in devices)
    fn()  # warm
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls
