"""`pyddp-bench allreduce`: an nccl-tests-style table (size, count, dtype,
time, algbw, busbw = algbw * 2(N-1)/N) for pyddp.all_reduce over N of the
chosen devices, side by side with references measured in the same run,
interleaved: a plain memory copy of the same bytes with torch `copy_` on the
first device (on a GPU an on-device copy; on CPU it may use every torch
thread), the same on the host with numpy `np.copyto` (one thread), and a
torch `add_` of the same two buffers on the first device: the cheapest torch
op there, so at small sizes `time / add_` is pyddp's per-call cost in units of
the floor any op pays (a launch on a GPU).

A reduction reads N buffers and writes N, a copy reads one and writes one, so
at memory speed algbw / copy tends to 1/N while the memory traffic
(2 * N * bytes / time) equals the copy's (2 * bytes / time)."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List

import numpy as np
import torch
from tqdm.auto import tqdm

import pyddp

from ._util import rotated, summary

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# Small sizes loop calls on the same buffers until about this many bytes have
# been reduced per sample, so the timer's resolution and the loop's own cost
# stay negligible next to the work timed (the data then sits in cache).
_BYTES_PER_SAMPLE = 64 << 20
_MAX_CALLS = 1000


def sizes(min_bytes: int, max_bytes: int, factor: int) -> List[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def run(
    devices: List[str],
    replicas: List[int],
    byte_sizes: List[int],
    dtype: str,
    op: str,
    reps: int,
    progress: bool = True,
) -> List[Dict[str, Any]]:
    """One row per (size, N): all-reduce over devices[:N] for each N in
    `replicas`, with the copy references of that size in every row."""
    dt = DTYPES[dtype]
    element = torch.tensor([], dtype=dt).element_size()
    cuda = any(d.startswith("cuda") for d in devices)
    rows = []
    # Sizes below one element's bytes run one element: each count once.
    counts = list(dict.fromkeys(max(1, size // element) for size in byte_sizes))
    for count in tqdm(counts, desc="all-reduce sizes", disable=not progress, leave=False):
        nbytes = count * element
        ops = _ops(devices, replicas, count, dt, op)
        calls = max(1, min(_MAX_CALLS, _BYTES_PER_SAMPLE // nbytes))
        samples: Dict[str, List[float]] = {name: [] for name in ops}
        for rep in range(reps + 1):  # round 0 is warm-up (page faults, pool start)
            for name in rotated(list(ops), rep):  # no op always follows the same one
                seconds = _time(ops[name], calls, cuda)
                if rep:
                    samples[name].append(seconds)
        copy, np_copy = summary(samples["copy"]), summary(samples["np copy"])
        add = summary(samples["add"])
        for n in replicas:
            t = summary(samples[f"N={n}"])
            algbw = nbytes / t["median"] / 1e9
            rows.append(
                {
                    "bytes": nbytes,
                    "count": count,
                    "dtype": dtype,
                    "op": op,
                    "replicas": n,
                    "calls_per_sample": calls,
                    "time_s": t,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * 2 * (n - 1) / n,
                    # Memory traffic: the reduction reads N buffers and writes N.
                    "traffic_GBps": 2 * n * nbytes / t["median"] / 1e9,
                    "copy_time_s": copy,
                    "copy_GBps": nbytes / copy["median"] / 1e9,
                    "np_copy_time_s": np_copy,
                    "np_copy_GBps": nbytes / np_copy["median"] / 1e9,
                    "algbw_over_copy": copy["median"] / t["median"],
                    "algbw_over_np_copy": np_copy["median"] / t["median"],
                    "add_time_s": add,
                    "time_over_add": t["median"] / add["median"],
                }
            )
    return rows


def _ops(
    devices: List[str], replicas: List[int], count: int, dt: torch.dtype, op: str
) -> Dict[str, Callable[[], None]]:
    # torch.zeros writes every page, so all buffers are real, distinct memory;
    # sums of zeros stay zero (never inf or denormal) however often they repeat.
    ops: Dict[str, Callable[[], None]] = {}
    for n in replicas:
        bufs = [torch.zeros(count, dtype=dt, device=d) for d in devices[:n]]
        ops[f"N={n}"] = lambda bufs=bufs: pyddp.all_reduce(bufs, op=op)
    src, dst = (torch.zeros(count, dtype=dt, device=devices[0]) for _ in range(2))
    ops["copy"] = lambda: dst.copy_(src)
    ops["add"] = lambda: dst.add_(src)  # zeros: the sum stays zero
    # numpy has no bfloat16: copy the same bytes as int16.
    hsrc, hdst = torch.zeros(count, dtype=dt), torch.zeros(count, dtype=dt)
    nsrc, ndst = (t.view(torch.int16) if dt == torch.bfloat16 else t for t in (hsrc, hdst))
    nsrc, ndst = nsrc.numpy(), ndst.numpy()
    ops["np copy"] = lambda: np.copyto(ndst, nsrc)
    return ops


def _time(fn: Callable[[], None], calls: int, cuda: bool) -> float:
    if cuda:  # the reduction is queued on the device: time it done, not enqueued
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls
