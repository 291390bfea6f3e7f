"""What the engine costs per parameter. (a) The C++ mark_ready alone: one
thread, no-op backend, so only counting and queueing is timed. (b) The whole
hook path seen from Python: GradSync over N CPU replicas of a model with many
small parameters, every replica's backward run in turn on one thread, against
the same replicas without GradSync, interleaved iteration by iteration.

    python bench/engine_cost.py [--quick]"""

from __future__ import annotations

import copy
import os
import time
from typing import Dict, List, Optional, Set, Tuple

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
def _placements() -> Dict[str, Optional[Set[int]]]:
    """Where the engine's launcher thread may run. A new thread inherits its
    creator's CPU affinity, so pinning this thread while bench_mark_ready builds
    its engine puts the launcher on the marking core. Free, it wakes on another
    core for every queued bucket and contends for the engine's lock: the cost
    seen in real backward passes. Pinned, mostly the counting itself is left."""
    out: Dict[str, Optional[Set[int]]] = {"launcher free": None}
    if hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) > 1:
        out["launcher on marking core"] = {min(os.sched_getaffinity(0))}
    return out


def mark_ready_cost(replicas: List[int], params: List[int], calls: int, reps: int) -> List[Dict]:
    placements = _placements()
    grid = [(r, p, where) for r in replicas for p in params for where in placements]
    samples: Dict[Tuple[int, int, str], List[float]] = {g: [] for g in grid}
    for rep in range(reps + 1):  # round 0 is warm-up: engine construction, page faults
        for r, p, where in rotated(grid, rep):
            iterations = max(1, calls // (r * p))
            mask = placements[where]
            previous = os.sched_getaffinity(0) if mask else None
            try:
                if mask:
                    os.sched_setaffinity(0, mask)  # this thread only (Linux, pid 0)
                ns = _C.bench_mark_ready(r, p, iterations)
            finally:
                if previous:
                    os.sched_setaffinity(0, previous)
            if rep > 0:
                samples[(r, p, where)].append(ns)
    return [
        {"replicas": r, "params": p, "placement": w, "ns_per_call": summary(samples[(r, p, w)])}
        for r, p, w in grid
    ]


# ------------------------------------------------------- (b) the hook path
class Variant:
    """N replicas and how one iteration zeroes, runs and finishes them."""

    def __init__(
        self,
        name: str,
        replicas: List[nn.Module],
        sync: pyddp.GradSync | None = None,
        set_to_none: bool = False,
    ):
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

    def synced(name: str, cap: float) -> Variant:
        reps = copies()
        return Variant(name, reps, pyddp.GradSync(reps, bucket_cap_mb=cap))

    def noop_hooked() -> Variant:
        # The floor of any design that feeds the engine from a Python hook:
        # autograd calling an empty Python function per parameter.
        reps = copies()
        for m in reps:
            for p in m.parameters():
                p.register_post_accumulate_grad_hook(lambda p: None)
        return Variant("bare + no-op Python hook", reps)

    variants = [
        # The reference: grads kept and zeroed in place, so backward accumulates
        # into existing tensors exactly as it does into GradSync's bucket views.
        Variant("bare (grads zeroed in place)", copies()),
        Variant("bare (grads set to None)", copies(), set_to_none=True),
        noop_hooked(),
        synced("GradSync per-parameter (cap 0)", 0.0),
        synced("GradSync bucketed (cap 25 MB)", 25.0),
    ]
    for i in range(warmup + iters):
        for v in rotated(variants, i):
            v.iteration(x, record=i >= warmup)
    params = sum(1 for _ in base.parameters())
    ref = variants[0]
    out = {
        "replicas": n,
        "params_per_replica": params,
        "layers": layers,
        "width": width,
        "batch": batch,
        "variants": [],
    }
    for v in variants:
        # Paired differences: iteration i of every variant ran in the same round.
        d_bwd = [b - rb for b, rb in zip(v.bwd, ref.bwd)]
        d_fwd = [f - rf for f, rf in zip(v.fwd, ref.fwd)]
        per_param = [d / (params * n) * 1e6 for d in d_bwd]
        out["variants"].append(
            {
                "name": v.name,
                "forward_s": summary(v.fwd),
                "backward_s": summary(v.bwd),
                "backward_minus_ref_s": summary(d_bwd),
                "forward_minus_ref_s": summary(d_fwd),
                "us_per_param_replica": summary(per_param),
            }
        )
        if v.sync is not None:
            out["variants"][-1]["buckets"] = len(v.sync.buckets)
    return out


def _print_marks(marks: List[Dict]) -> None:
    where = list(dict.fromkeys(m["placement"] for m in marks))
    by_key = {(m["replicas"], m["params"], m["placement"]): m["ns_per_call"] for m in marks}
    headers = ["replicas", "params"]
    for w in where:
        headers += [f"{w}: ns/call", "p10", "p90"]
    rows = []
    for r, p in dict.fromkeys((m["replicas"], m["params"]) for m in marks):
        row: List[object] = [r, p]
        for w in where:
            s = by_key[(r, p, w)]
            row += [s["median"], s["p10"], s["p90"]]
        rows.append(row)
    print(table(headers, rows))


def _print_hooks(res: Dict) -> None:
    rows = []
    for v in res["variants"]:
        b, d, u = v["backward_s"], v["backward_minus_ref_s"], v["us_per_param_replica"]
        rows.append(
            [v["name"], v.get("buckets", "-"), v["forward_s"]["median"] * 1e3]
            + [b["median"] * 1e3, b["p10"] * 1e3, b["p90"] * 1e3, d["median"] * 1e3]
            + [u["median"], u["p10"], u["p90"]]
        )
    headers = ["variant", "buckets", "fwd ms", "bwd+finish ms", "p10", "p90", "Δbwd ms"]
    print(table(headers + ["µs/param Δ", "p10", "p90"], rows))


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=200, help="Linear layers in the (b) model")
    p.add_argument("--width", type=int, default=4, help="in = out features of each Linear")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=60, help="(b) timed iterations per variant")
    p.add_argument("--reps", type=int, default=11, help="(a) samples per configuration")
    args = p.parse_args()
    calls = 200_000
    replica_counts = [2, 4]
    if args.quick:
        args.iters, args.reps, args.layers, calls = 5, 3, 20, 20_000
        replica_counts = [2]

    print(header() + "\n")
    print(
        f"(a) C++ mark_ready on one thread, no-op backend, ~{calls} calls per sample, "
        f"{args.reps} samples.\nPer-parameter buckets: the last replica's mark of a "
        "parameter also queues its bucket and wakes the launcher thread."
    )
    marks = mark_ready_cost([1, 2, 4], [100, 1000], calls, args.reps)
    _print_marks(marks)

    hooks = []
    for n in replica_counts:
        res = hook_cost(n, args.layers, args.width, args.batch, args.iters, warmup=5)
        hooks.append(res)
        print(
            f"\n(b) hook path: {n} CPU replicas x {res['params_per_replica']} parameters "
            f"({args.layers} x Linear({args.width},{args.width}), batch {args.batch}), "
            f"one thread, {args.iters} interleaved iterations; times per iteration, all replicas"
        )
        _print_hooks(res)
    print(
        "\nΔ = paired difference to 'bare (grads zeroed in place)' in the same round; "
        "µs/param = Δbwd / (params x replicas)."
    )
    write_results("engine_cost", args, {"mark_ready": marks, "hook_path": hooks})


if __name__ == "__main__":
    main()
