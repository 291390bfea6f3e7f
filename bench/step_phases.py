"""Where a step's time goes across processes, pyddp against torch DDP in the
same processes: the `pyddp-bench overlap --processes 2` step (2 processes x
1 CPU replica under torchrun, 1 intra-op thread each, the MLP of that
benchmark; forward and loss, backward, zero_grad, no optimizer step), each
phase timed on rank 0 with perf_counter_ns. The engines alternate sample by
sample (which goes first alternates too), every sample starting at a
barrier. Prints per run the phase medians in µs and pyddp's difference;
the backward holds the wait for gloo's all-reduce, which moves by hundreds
of µs from run to run, the forward and zero_grad hold each engine's own
per-step work.

    python bench/step_phases.py [--repeats 3] [--rounds 300] [--steps 5] [--width 128] [--depth 3]
                                [--bucket-cap-mb MB]

Results: bench/results/step_phases.json (-quick.json with --quick)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

from _common import parser, write_results

PHASES = ("forward", "backward", "zero_grad", "step")


def run(width: int, depth: int, rounds: int, steps: int, cap: Optional[float]) -> None:
    """One run, in each torchrun process; rank 0 prints its medians as JSON."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import pyddp
    from pyddp.bench._util import rotated
    from pyddp.bench.multiproc import make_input, make_model

    torch.set_num_threads(1)
    pyddp.init()
    rank, world = pyddp.rank(), pyddp.world()
    bench_group, ddp_group = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    x, y = make_input("mlp", width, 128)
    xs, ys = x[rank::world], y[rank::world]
    torch.manual_seed(0)
    caps = {} if cap is None else {"bucket_cap_mb": cap, "first_bucket_cap_mb": cap}
    dm = pyddp.wrap(make_model("mlp", width, depth), ["cpu"], **caps)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(make_model("mlp", width, depth), process_group=ddp_group)
    times: Dict[str, Dict[str, List[int]]] = {e: {k: [] for k in PHASES} for e in ("pyddp", "ddp")}

    def sample(name: str, model: Any, timed: bool) -> None:
        for _ in range(steps):
            t0 = time.perf_counter_ns()
            loss = F.cross_entropy(model(xs), ys)
            t1 = time.perf_counter_ns()
            loss.backward()
            t2 = time.perf_counter_ns()
            model.zero_grad()
            t3 = time.perf_counter_ns()
            if timed:
                for k, v in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    times[name][k].append(v)

    for r in range(rounds + 1):  # round 0 warms up both engines
        for name, model in rotated([("pyddp", dm), ("ddp", ddp)], r):
            dist.barrier(group=bench_group)
            sample(name, model, r > 0)
    if rank == 0:
        out = {e: {k: statistics.median(v) / 1e3 for k, v in t.items()} for e, t in times.items()}
        print("PHASES " + json.dumps(out), flush=True)
    dm.close()
    dist.destroy_process_group()


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=3, help="runs (each its own torchrun)")
    p.add_argument("--rounds", type=int, default=300, help="interleaved samples per run")
    p.add_argument("--steps", type=int, default=5, help="steps per sample")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="pyddp's bucket_cap_mb and first_bucket_cap_mb (default: DDP's)",
    )
    p.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_side:
        run(args.width, args.depth, args.rounds, args.steps, args.bucket_cap_mb)
        return
    repeats, rounds = (1, 5) if args.quick else (args.repeats, args.rounds)
    if repeats < 1 or rounds < 1 or args.steps < 1:
        p.error("--repeats, --rounds and --steps must be >= 1")
    runs: List[Dict[str, Dict[str, float]]] = []
    print(f"µs per step, medians on rank 0 ({rounds} samples x {args.steps} steps per engine)")
    print(f"{'run':4s} {'phase':10s} {'pyddp':>9s} {'DDP':>9s} {'pyddp-DDP':>10s}")
    for rep in range(repeats):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               os.path.abspath(__file__), "--rank-side", "--rounds", str(rounds),
               "--steps", str(args.steps), "--width", str(args.width),
               "--depth", str(args.depth)]  # fmt: skip
        if args.bucket_cap_mb is not None:
            cmd += ["--bucket-cap-mb", str(args.bucket_cap_mb)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        line = [s for s in done.stdout.splitlines() if s.startswith("PHASES ")]
        if done.returncode != 0 or not line:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        got = json.loads(line[-1][len("PHASES ") :])
        runs.append(got)
        for k in PHASES:
            a, b = got["pyddp"][k], got["ddp"][k]
            print(f"{rep + 1:<4d} {k:10s} {a:9.1f} {b:9.1f} {a - b:+10.1f}", flush=True)
    diffs = {k: statistics.median(r["pyddp"][k] - r["ddp"][k] for r in runs) for k in PHASES}
    print("median over runs of pyddp - DDP (µs): "
          + ", ".join(f"{k} {v:+.1f}" for k, v in diffs.items()))  # fmt: skip
    write_results("step_phases", args, {"rounds": rounds, "steps": args.steps,
                                        "width": args.width, "depth": args.depth,
                                        "bucket_cap_mb": args.bucket_cap_mb,
                                        "runs": runs, "median_diff_us": diffs})  # fmt: skip


if __name__ == "__main__":
    main()
