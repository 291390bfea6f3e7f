"""In-process CPU all-reduce bandwidth through `pyddp.all_reduce` (one buffer
per replica, float32, sum) for 2 and 4 replicas, against a plain memory copy
of a buffer of the same size (torch `dst.copy_(src)` and numpy `np.copyto`)
measured in the same run, interleaved, so the copy is the memory-bandwidth
yardstick of this machine at this moment.

    python bench/allreduce_cpu.py [--quick]"""

from __future__ import annotations

import time
from typing import Callable, Dict, List

import numpy as np
import torch
from _common import header, parser, rotated, summary, table, write_results

import pyddp

KIB = 1 << 10
MIB = 1 << 20
# Small sizes loop this many bytes per sample so the timer's resolution and
# the loop's own cost stay negligible next to the work timed.
_BYTES_PER_SAMPLE = 4 * MIB


def _size_name(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def _ops(nbytes: int, replicas: List[int]) -> Dict[str, Callable[[], None]]:
    count = nbytes // 4
    # torch.zeros writes every page (memset), so all buffers are real, distinct
    # memory; sums of zeros stay zero, never denormal, whatever the repeat count.
    ops: Dict[str, Callable[[], None]] = {}
    for n in replicas:
        bufs = [torch.zeros(count) for _ in range(n)]
        ops[f"all_reduce N={n}"] = lambda bufs=bufs: pyddp.all_reduce(bufs)
    src, dst = torch.zeros(count), torch.zeros(count)
    ops["torch copy_"] = lambda: dst.copy_(src)
    nsrc, ndst = src.numpy(), dst.numpy()
    ops["np.copyto"] = lambda: np.copyto(ndst, nsrc)
    return ops


def measure(nbytes: int, replicas: List[int], reps: int) -> Dict[str, Dict]:
    ops = _ops(nbytes, replicas)
    inner = max(1, _BYTES_PER_SAMPLE // nbytes)
    names = list(ops)
    samples: Dict[str, List[float]] = {k: [] for k in names}
    for rep in range(reps + 1):  # round 0 is warm-up (page faults, pool start)
        for name in rotated(names, rep):
            fn = ops[name]
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            dt = (time.perf_counter() - t0) / inner
            if rep > 0:
                samples[name].append(dt)
    out = {}
    for name in names:
        n = int(name.split("=")[1]) if name.startswith("all_reduce") else 1
        # Memory traffic: the reduction reads N buffers and writes N (the sum
        # back into every replica); a copy (n = 1) reads 1 and writes 1.
        traffic = 2 * n * nbytes
        t = summary(samples[name])
        out[name] = {
            "replicas": n,
            "calls_per_sample": inner,
            "time_s": t,
            "algbw_GBps": nbytes / t["median"] / 1e9,
            "busbw_GBps": nbytes / t["median"] / 1e9 * 2 * (n - 1) / n if n > 1 else None,
            "traffic_GBps": traffic / t["median"] / 1e9,
        }
    for key, ref in (("algbw_over_torch_copy", "torch copy_"), ("algbw_over_np_copy", "np.copyto")):
        for r in out.values():
            r[key] = r["algbw_GBps"] / out[ref]["algbw_GBps"]
    return out


def _time(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} µs" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms"


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=60, help="timed samples per size and operation")
    p.add_argument("--max-mib", type=int, default=64, help="largest buffer per replica (MiB)")
    args = p.parse_args()
    if args.quick:
        args.reps, args.max_mib = 3, 4
    sizes = [KIB, 64 * KIB, MIB] + [s * MIB for s in (4, 16, 64, 256) if s <= args.max_mib]
    if args.max_mib * MIB not in sizes:
        sizes.append(args.max_mib * MIB)
    replicas = [2, 4]

    print(header())
    print(
        f"float32 sum, {args.reps} interleaved samples per size; pyddp CPU backend threads: "
        f"{pyddp._C.CpuBackend().threads}. Small sizes time a loop of calls on the same\n"
        "buffers per sample, so they measure per-call cost with the data in cache.\n"
    )
    results = []
    rows = []
    for nbytes in sizes:
        res = measure(nbytes, replicas, args.reps)
        results.append({"bytes_per_replica": nbytes, "ops": res})
        for name, r in res.items():
            t = r["time_s"]
            rows.append(
                [
                    _size_name(nbytes),
                    name,
                    _time(t["median"]),
                    _time(t["p10"]),
                    _time(t["p90"]),
                    r["algbw_GBps"],
                    "-" if r["busbw_GBps"] is None else r["busbw_GBps"],
                    r["traffic_GBps"],
                    r["algbw_over_torch_copy"],
                    r["algbw_over_np_copy"],
                ]
            )
        rows.append([""] * 10)
    print(
        table(
            [
                "size/replica",
                "operation",
                "median",
                "p10",
                "p90",
                "algbw GB/s",
                "busbw GB/s",
                "traffic GB/s",
                "algbw÷torch copy",
                "algbw÷np copy",
            ],
            rows[:-1],
        )
    )
    print(
        "\nalgbw = bytes per replica / time; busbw = algbw x 2(N-1)/N (NCCL's convention).\n"
        "traffic = bytes moved through memory / time: 2 x N x bytes for the reduction (it\n"
        "reads N buffers and writes N), 2 x bytes for a copy (reads 1, writes 1). So an\n"
        "all-reduce at copy speed has algbw÷copy = 1/N while its traffic equals the copy's.\n"
        f"GB = 1e9 bytes. torch copy_ may use {torch.get_num_threads()} threads; np.copyto uses 1."
    )
    big = results[-1]["ops"]
    summary_line = {
        name: round(r["traffic_GBps"] / big["torch copy_"]["traffic_GBps"], 3)
        for name, r in big.items()
    }
    print(f"at {_size_name(sizes[-1])}: traffic ÷ torch-copy traffic = {summary_line}")
    write_results("allreduce_cpu", args, {"sizes": results})


if __name__ == "__main__":
    main()
