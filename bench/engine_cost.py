"""What the engine costs per parameter. (a) The C++ mark_ready alone: one
thread, no-op backend, so only counting and queueing is timed. (b) The whole
hook path seen from Python: GradSync over N CPU replicas of a model with many
small parameters, every replica's backward run in turn on one thread, against
the same replicas without GradSync, interleaved iteration by iteration.

    python bench/engine_cost.py [--quick]"""

from __future__ import annotations

import copy
import time
from typing import Dict, List, Tuple

import torch
from _common import header, parser, rotated, summary, table, write_results
from torch import nn

import pyddp
from pyddp import _C


class ManySmall(nn.Module):
    """`layers` Linear(width, width) applied to the same input and summed: many
    parameters, little arithmetic, so per-parameter overhead dominates."""

    def __init__(self, layers: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers[0](x)
        for layer in self.layers[1:]:
            out = out + layer(x)
        return out.sum()


# ------------------------------------------------------------ (a) mark_ready
def mark_ready_cost(replicas: List[int], params: List[int], calls: int, reps: int) -> List[Dict]:
    grid = [(r, p) for r in replicas for p in params]
    samples: Dict[Tuple[int, int], List[float]] = {g: [] for g in grid}
    for g in grid:  # warm-up: first engine construction, page faults
        _C.bench_mark_ready(g[0], g[1], 1)
    for rep in range(reps):
        for r, p in rotated(grid, rep):
            iterations = max(1, calls // (r * p))
            samples[(r, p)].append(_C.bench_mark_ready(r, p, iterations))
    return [{"replicas": r, "params": p, "ns_per_call": summary(samples[(r, p)])} for r, p in grid]


# ------------------------------------------------------- (b) the hook path
class Variant:
    """N replicas and how one iteration zeroes, runs and finishes them."""

    def __init__(self, name: str, replicas: List[nn.Module], sync: pyddp.GradSync | None,
                 set_to_none: bool):
        self.name = name
        self.replicas = replicas
        self.sync = sync
        self.set_to_none = set_to_none
        self.fwd: List[float] = []
        self.bwd: List[float] = []  # every replica's backward, plus finish()

    def zero(self) -> None:
        if self.sync is not None:
            self.sync.zero_grad()
            return
        for m in self.replicas:
            for p in m.parameters():
                if self.set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def iteration(self, x: torch.Tensor, record: bool) -> None:
        self.zero()  # not timed: the comparison is about backward
        fwd = bwd = 0.0
        for m in self.replicas:
            t0 = time.perf_counter()
            loss = m(x)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            fwd += t1 - t0
            bwd += t2 - t1
        t3 = time.perf_counter()
        if self.sync is not None:
            self.sync.finish()
        bwd += time.perf_counter() - t3
        if record:
            self.fwd.append(fwd)
            self.bwd.append(bwd)


def hook_cost(n: int, layers: int, width: int, batch: int, iters: int, warmup: int) -> Dict:
    torch.manual_seed(0)
    base = ManySmall(layers, width)
    x = torch.randn(batch, width)

    def copies() -> List[nn.Module]:
        return [copy.deepcopy(base) for _ in range(n)]

    def synced(cap: float) -> Tuple[List[nn.Module], pyddp.GradSync]:
        reps = copies()
        return reps, pyddp.GradSync(reps, bucket_cap_mb=cap)

    per_param_reps, per_param_sync = synced(0.0)
    bucketed_reps, bucketed_sync = synced(25.0)
    variants = [
        # The reference: grads kept and zeroed in place, so backward accumulates
        # into existing tensors exactly as it does into GradSync's bucket views.
        Variant("bare (grads zeroed in place)", copies(), None, set_to_none=False),
        Variant("bare (grads set to None)", copies(), None, set_to_none=True),
        Variant("GradSync per-parameter (cap 0)", per_param_reps, per_param_sync, False),
        Variant("GradSync bucketed (cap 25 MB)", bucketed_reps, bucketed_sync, False),
    ]
    for i in range(warmup + iters):
        for v in rotated(variants, i):
            v.iteration(x, record=i >= warmup)
    params = sum(1 for _ in base.parameters())
    ref = variants[0]
    out = {"replicas": n, "params_per_replica": params, "layers": layers, "width": width,
           "batch": batch, "variants": []}
    for v in variants:
        # Paired differences: iteration i of every variant ran in the same round.
        d_bwd = [b - rb for b, rb in zip(v.bwd, ref.bwd)]
        d_fwd = [f - rf for f, rf in zip(v.fwd, ref.fwd)]
        per_param = [d / (params * n) * 1e6 for d in d_bwd]
        out["variants"].append({
            "name": v.name,
            "forward_s": summary(v.fwd),
            "backward_s": summary(v.bwd),
            "backward_minus_ref_s": summary(d_bwd),
            "forward_minus_ref_s": summary(d_fwd),
            "us_per_param_replica": summary(per_param),
        })
        if v.sync is not None:
            out["variants"][-1]["buckets"] = len(v.sync.buckets)
    return out


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=200, help="Linear layers in the (b) model")
    p.add_argument("--width", type=int, default=4, help="in = out features of each Linear")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=80, help="(b) timed iterations per variant")
    p.add_argument("--reps", type=int, default=15, help="(a) repetitions per configuration")
    args = p.parse_args()
    calls = 200_000
    replica_counts = [2, 4]
    if args.quick:
        args.iters, args.reps, args.layers, calls = 5, 3, 20, 20_000
        replica_counts = [2]

    print(header() + "\n")
    print("(a) C++ mark_ready, one thread, no-op backend "
          f"(~{calls} calls per sample, {args.reps} samples; per-parameter buckets, so the "
          "last replica's mark also queues the bucket for the launcher)")
    marks = mark_ready_cost([1, 2, 4], [100, 1000], calls, args.reps)
    print(table(
        ["replicas", "params", "ns/call median", "p10", "p90"],
        [[m["replicas"], m["params"], m["ns_per_call"]["median"], m["ns_per_call"]["p10"],
          m["ns_per_call"]["p90"]] for m in marks],
    ))

    hooks = []
    for n in replica_counts:
        res = hook_cost(n, args.layers, args.width, args.batch, args.iters, warmup=5)
        hooks.append(res)
        P = res["params_per_replica"]
        print(f"\n(b) hook path: {n} CPU replicas x {P} parameters ({args.layers} x "
              f"Linear({args.width},{args.width}), batch {args.batch}), one thread, "
              f"{args.iters} interleaved iterations; times are per iteration (all replicas)")
        rows = []
        for v in res["variants"]:
            b, d, u = v["backward_s"], v["backward_minus_ref_s"], v["us_per_param_replica"]
            rows.append([
                v["name"], v.get("buckets", "-"), v["forward_s"]["median"] * 1e3,
                b["median"] * 1e3, b["p10"] * 1e3, b["p90"] * 1e3, d["median"] * 1e3,
                u["median"], u["p10"], u["p90"],
            ])
        print(table(
            ["variant", "buckets", "fwd ms", "bwd+finish ms", "p10", "p90", "Δbwd ms",
             "µs/param Δ", "p10", "p90"],
            rows,
        ))
    print("\nΔ = paired difference to 'bare (grads zeroed in place)' in the same round; "
          "µs/param = Δbwd / (params x replicas).")
    write_results("engine_cost", args, {"mark_ready": marks, "hook_path": hooks})


if __name__ == "__main__":
    main()
