"""`pyddp-bench simulate`: a data-parallel step on 1 to hundreds of GPUs,
predicted without a GPU, for each gradient-sync policy.

Inputs: a Profile (costmodel.py) of one device's step, the forward, backward
and optimizer times and each parameter's gradient size and ready time in
backward, either priced on a GPU's roofline from the operators autograd ran
(`costmodel.record` + `costmodel.price`) or measured (`Profile.load`, written
from a real run by `profile_from_timeline`); and a System (hardware.py): GPU,
node and network, with NCCL's own cost model of an all-reduce.

Policies (weak scaling: the per-device batch stays the same at every count):
- "no overlap": every gradient reduced after backward, in pyddp's buckets.
- "pyddp per-parameter": each gradient reduced as soon as it is ready
  (`bucket_cap_mb=0`).
- "pyddp bucketed": pyddp's own bucket plan (`plan_buckets`, the engine's
  csrc/bucket_plan.cpp rule, over the ready order it records on the first
  iteration; 1 MiB first bucket, then 25 MiB: torch DDP's rebuilt plan),
  each bucket launched as soon as it is complete (`reduce_order="ready"`).
  "pyddp bucketed, tapered": the same with `taper_buckets=True` (the last
  buckets shrink by halves down to 1 MiB).
- "torch DDP": torch's own bucket assignment
  (`torch.distributed._compute_bucket_assignment_by_size`, [1 MiB, 25 MiB]) over
  the ready order its Reducer rebuilds after the first iteration, buckets
  launched strictly in index order (a complete bucket waits for the ones
  before it, reducer.cpp `mark_bucket_ready`).
- "torch DDP, registration order": its first plan, in reverse order of
  model.parameters(), which it keeps when it never rebuilds
  (find_unused_parameters=True); same launch rule.
- "one all-reduce" (validation): every gradient in one flat buffer, reduced
  after backward (NVIDIA's BERT pre-training, allreduce_post_accumulation).
- "horovod" (validation): Tensor Fusion as Horovod had it in 2017-2020:
  every 5 ms cycle, the gradients ready by then are fused into reductions of
  at most 64 MB (docs/tensor-fusion.rst; defaults until v0.21).

Reductions run one at a time on one communication stream (as NCCL on one
stream does), each priced by hardware.System.allreduce_s; a step is
    forward + max(backward, end of the last reduction) + optimizer
(with gradient accumulation over k micro-batches, k - 1 more forward and
backward passes come first and only the last overlaps the reductions).
Efficiency = the one-device step / the step at n devices.

Compression ("fp16"/"bf16": torch DDP's fp16_compress_hook and
bf16_compress_hook, which pyddp runs too): each reduction moves half the
bytes (float32 gradients sent as 16-bit values) and costs three
memory-bound kernels more on its path, as the hook runs them: the cast down
(read 4, write 2 bytes per value), the division by the world (read 2, write
2) and the copy back into the bucket (read 2, write 4), each at
Gpu.memory_eff of the HBM bandwidth and at least Gpu.kernel_floor_s.

Sharded optimizer state ("zero1": ZeRO stage 1, pyddp's `shard=True`, as
torch's ZeroRedundancyOptimizer and DeepSpeed run it; "zero2": stage 2,
pyddp's `shard="gradients"`; pyddp makes exactly these exchanges): each GPU
steps 1/n of the parameters (the optimizer step, elementwise and
memory-bound, takes 1/n of its time), then an all-gather of every
parameter follows the step, exposed; "zero2" also reduce-scatters each
bucket (each GPU keeps its shard of the sum) instead of all-reducing it.
Reduce-scatter and all-gather are priced by NCCL's ring model for them
(hardware.System.gather_s).

Compute slowed by NCCL kernels, per-step framework overheads, stragglers
and jitter are not simulated from first principles: simulate.Effects adds
them as three coefficients fitted to published results (FITTED, on by
default; --no-effects leaves them out). Not modelled: the input pipeline,
GPU memory capacity, NVLink SHARP and in-network reduction, low-rank
compression (PowerSGD: its cost depends on each matrix's shape, which a
profile does not keep), host launch overheads. See docs/simulator.md's validation
table for what that costs against published results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ... import plan_buckets
from .._util import pyplot, save_figure
from .checks import bucket_cap, gpu_count
from .costmodel import Profile
from .hardware import System

MIB = 1 << 20
POLICIES = (
    "no overlap",
    "pyddp per-parameter",
    "pyddp bucketed",
    "torch DDP",
    "torch DDP, registration order",
)
# Also accepted, not in the default comparison.
MORE_POLICIES = ("pyddp bucketed, tapered", "horovod", "one all-reduce")
PLANS = (
    "pyddp bucketed, tapered",
    "pyddp bucketed",
    "torch DDP",
    "torch DDP, registration order",
)
COMPRESSIONS = ("none", "fp16", "bf16")
SHARDINGS = ("none", "zero1", "zero2")
# Bytes each compression hook's kernels read and write per float32 gradient
# value: cast to 16 bits (4 + 2), divide by the world (2 + 2), copy back (2 + 4).
_HOOK_BYTES_PER_VALUE = 16
_HOOK_KERNELS = 3
HOROVOD_CYCLE_S = 5e-3
HOROVOD_FUSION_BYTES = 64 * MIB


@dataclass(frozen=True)
class Effects:
    """What running on several GPUs costs beyond the communication's own
    time, each per optimizer step at n > 1 GPUs (published.py fits them on
    its fit half of the published results; FITTED holds the result):

    - overhead: the per-step cost of running distributed at all, a fraction
      of one micro-batch's forward and backward (the framework's hooks and
      bucket copies, NCCL's launches; torch DDP's own benchmark shows 3% on
      one GPU against no DDP, pytorch/benchmarks/distributed/ddp/README.md).
    - interference: compute slowed by NCCL kernels running beside it (they
      take SMs and memory bandwidth): each second of reduction that overlaps
      backward adds this many seconds to backward.
    - jitter: each GPU's micro-batch time varies with this coefficient of
      variation (independent between GPUs and micro-batches); a synchronous
      step waits for the slowest of n, on average
      jitter x micro-batch time x sqrt(micro-batches) x E[max of n standard
      normals] longer (stragglers: it grows with the log of n)."""

    overhead: float = 0.0
    interference: float = 0.0
    jitter: float = 0.0

    @staticmethod
    def terms(
        gpus: int, compute_s: float, accumulate: int, overlap_s: float
    ) -> Tuple[float, float, float]:
        """What overhead, interference and jitter multiply at `gpus` GPUs
        (`compute_s`: one micro-batch's forward and backward; `overlap_s`:
        reduction time overlapping backward): all zero on one GPU."""
        if gpus <= 1:
            return (0.0, 0.0, 0.0)
        return (
            compute_s,
            overlap_s,
            compute_s * math.sqrt(accumulate) * expected_max_normal(gpus),
        )

    def extra_s(self, gpus: int, compute_s: float, accumulate: int, overlap_s: float) -> float:
        """Seconds these effects add to a step (the arguments as terms')."""
        o, i, j = self.terms(gpus, compute_s, accumulate, overlap_s)
        return self.overhead * o + self.interference * i + self.jitter * j


@dataclass(frozen=True)
class Band:
    """How far published efficiencies fell from the FITTED predictions out of sample
    (published.cross_validate): `coverage` of them lay from `below` under to `above` over."""

    below: float
    above: float
    coverage: float = 0.8

    def around(self, efficiency: float) -> Tuple[float, float]:
        """Within 0..1, as an efficiency is (a probe saw -4-4% and 93-101%)."""
        low, high = efficiency - self.below / 100, efficiency + self.above / 100  # (either < 0)
        return min(max(low, 0.0), 1.0), min(max(high, 0.0), 1.0)


NO_EFFECTS = Effects()
# published.fit() on the fit half (tests check that a fresh fit gives these).
FITTED = Effects(overhead=0.0125, interference=0.05, jitter=0.027)
# published.band(published.cross_validate()): how far out-of-sample
# predictions missed (tests check that a fresh cross-validation gives it).
BAND = Band(below=4.5, above=3.8, coverage=0.8)


@cache
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for one), by quadrature."""
    if n <= 1:
        return 0.0
    total, steps, lo, hi = 0.0, 4000, -8.0, 8.0
    h = (hi - lo) / steps
    for i in range(steps + 1):
        x = lo + i * h
        density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        w = 0.5 if i in (0, steps) else 1.0
        total += w * x * n * density * cdf ** (n - 1)
    return total * h


@dataclass
class Step:
    step_s: float
    ideal_s: float
    comm_s: float  # sum of the reductions' times
    exposed_s: float  # step - ideal
    reductions: int
    algorithms: Dict[str, int]
    overlap_s: float = 0.0  # reduction time that overlapped backward
    effects_s: float = 0.0  # what the Effects added

    @property
    def efficiency(self) -> float:
        return self.ideal_s / self.step_s


def buckets(profile: Profile, policy: str, cap_mb: Optional[float] = None) -> List[List[int]]:
    """The parameter groups `policy` reduces together, in launch-plan order.
    `cap_mb` None: each engine's defaults (25 MiB buckets after a 1 MiB
    first one). Given: pyddp keeps its 1 MiB first bucket
    (`first_bucket_cap_mb`), torch DDP makes its first bucket that size too
    (torch.nn.parallel.distributed `_BucketCapacityConfig`: the 1 MiB first
    bucket only when bucket_cap_mb is left to its default)."""
    order = profile.ready_order()
    dtypes = profile.dtypes or ["float32"] * len(order)
    cap = int((25.0 if cap_mb is None else cap_mb) * MIB)
    if policy == "pyddp per-parameter":
        return [[i] for i in order]
    if policy in ("pyddp bucketed", "pyddp bucketed, tapered", "no overlap"):
        taper = policy == "pyddp bucketed, tapered"
        return plan_buckets(profile.numels(), dtypes, order, MIB if cap else 0, cap, taper)
    if policy.startswith("torch DDP"):
        import torch.distributed as dist

        tensors = [
            torch.empty(n, dtype=getattr(torch, d), device="meta")
            for n, d in zip(profile.numels(), dtypes)
        ]
        limits = [MIB if cap_mb is None else cap, cap]
        if policy == "torch DDP":  # the plan its Reducer rebuilds from the ready order
            plan = dist._compute_bucket_assignment_by_size(
                [tensors[i] for i in order], limits, [False] * len(order), order
            )[0]
            return [list(b) for b in plan]
        if policy == "torch DDP, registration order":  # its first plan, never rebuilt
            plan = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
            return [list(b) for b in reversed(plan[0])]
    raise ValueError(
        f"policy {policy!r}: one of {', '.join(POLICIES)}, pyddp bucketed, tapered, horovod, "
        "one all-reduce"
    )


def step(
    profile: Profile,
    system: System,
    gpus: int,
    policy: str,
    accumulate: int = 1,
    cap_mb: Optional[float] = None,
    compression: str = "none",
    sharding: str = "none",
    effects: Effects = NO_EFFECTS,
) -> Step:
    """One step of `policy` on `gpus` GPUs of `system`, its float32 gradients
    reduced as they are or through a 16-bit `compression` hook, with the
    optimizer state whole on every GPU or sharded (`sharding`), plus what
    `effects` add (simulate's default: none; the CLI: FITTED)."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression={compression!r}: one of {', '.join(COMPRESSIONS)}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r}: one of {', '.join(SHARDINGS)}")
    if compression != "none" and any("16" in d for d in profile.dtypes or []):
        raise ValueError(
            f"compression={compression!r} casts float32 gradients to 16 bits; this profile's "
            "gradients are 16-bit already (nothing to compress)"
        )
    if accumulate < 1:
        raise ValueError(
            f"accumulate={accumulate}: give the number of micro-batches per step, >= 1"
        )
    gpus, _ = gpu_count(gpus), bucket_cap(cap_mb)
    if getattr(system, "inter_busbw", 1) <= 0:  # (a test's stand-in has neither)
        system.topology(gpus)  # more than one node without a network: refused by name
    ideal = profile.step_s(accumulate)
    if gpus == 1:
        return Step(ideal, ideal, 0.0, 0.0, 0, {})
    sizes = profile.param_bytes
    scatter = sharding == "zero2"
    if policy == "horovod":
        groups = _fused(
            profile,
            lambda nbytes: reduction_s(system, nbytes, gpus, compression, scatter),
            HOROVOD_CYCLE_S + negotiation_s(system, gpus),
        )
    elif policy == "one all-reduce":
        groups = [(profile.backward_s, sum(sizes))]
    else:
        plan = buckets(profile, policy, cap_mb)
        ready = [max(profile.param_ready_s[i] for i in b) for b in plan]
        if policy == "no overlap":
            ready = [profile.backward_s] * len(plan)
        if policy.startswith("torch DDP"):  # launched in index order
            ready = [max(ready[: k + 1]) for k in range(len(ready))]
        groups = sorted(
            ((r, sum(sizes[i] for i in b)) for r, b in zip(ready, plan)), key=lambda g: g[0]
        )
    clock, comm, overlap, algorithms = 0.0, 0.0, 0.0, {}
    for ready_s, nbytes in groups:
        cost = reduction_s(system, nbytes, gpus, compression, scatter)
        start = max(clock, ready_s)
        clock = start + cost
        comm += cost
        overlap += max(0.0, min(clock, profile.backward_s) - start)
        wire = nbytes / 2 if compression != "none" else nbytes
        name = "ring/reduce-scatter" if scatter else system.algorithm(wire, gpus)
        algorithms[name] = algorithms.get(name, 0) + 1
    total = ideal - profile.backward_s + max(profile.backward_s, clock)
    if sharding != "none":  # each GPU steps its shard, then every parameter is gathered
        gather = system.gather_s(sum(sizes), gpus)
        total += profile.optimizer_s / gpus - profile.optimizer_s + gather
        comm += gather
        algorithms["ring/all-gather"] = 1
    extra = effects.extra_s(gpus, profile.forward_s + profile.backward_s, accumulate, overlap)
    total += extra
    if not math.isfinite(total):  # (inf and nan rows were printed: a probe)
        raise ValueError(f"the step ({accumulate} micro-batches, {gpus} GPUs) overflows")
    return Step(total, ideal, comm, total - ideal, len(groups), algorithms, overlap, extra)


def negotiation_s(system: System, gpus: int) -> float:
    """Horovod's coordination per cycle, as its timeline shows it
    (NEGOTIATE_ALLREDUCE): every rank tells the coordinator which tensors are
    ready and hears back what to reduce, a gather and a broadcast over the
    ranks: 2 x log2(n) network (or in-node) hops at NCCL's Simple ring hop
    latency for the system."""
    if gpus <= 1:
        return 0.0
    nodes, _ = system.topology(gpus)
    hop_us = system.hop_latency_us(across_nodes=nodes > 1)
    return 2 * math.ceil(math.log2(gpus)) * hop_us * 1e-6


def reduction_s(
    system: System, nbytes: float, gpus: int, compression: str = "none", scatter: bool = False
) -> float:
    """One bucket of `nbytes` float32 gradients reduced over `gpus` GPUs:
    NCCL's all-reduce (or reduce-scatter, `scatter`), or through a 16-bit
    compression hook (half the bytes, and the hook's kernels)."""
    collective = system.gather_s if scatter else system.allreduce_s
    if compression == "none":
        return collective(nbytes, gpus)
    gpu = system.gpu
    values = nbytes / 4
    memory = gpu.memory_bw * gpu.memory_eff
    kernels = max(_HOOK_KERNELS * gpu.kernel_floor_s, values * _HOOK_BYTES_PER_VALUE / memory)
    return collective(nbytes / 2, gpus) + kernels


def _fused(
    profile: Profile, cost: Callable[[int], float], cycle_s: float = HOROVOD_CYCLE_S
) -> List[Tuple[float, int]]:
    """Horovod's Tensor Fusion: (launch time, bytes) per fused reduction. Its
    background thread wakes every cycle, fuses what is ready (64 MB at most
    per reduction) and waits for those reductions before its next cycle (as
    Horovod's NCCL path did until its finalizer threads, v0.16)."""
    pending = sorted(range(len(profile.param_bytes)), key=lambda i: profile.param_ready_s[i])
    groups: List[Tuple[float, int]] = []
    tick, busy_until = cycle_s, 0.0
    while pending:
        ready = [i for i in pending if profile.param_ready_s[i] <= tick]
        pending = pending[len(ready) :]
        size = 0
        for i in ready + [-1]:
            if size and (i < 0 or size + profile.param_bytes[i] > HOROVOD_FUSION_BYTES):
                groups.append((tick, size))
                busy_until = max(busy_until, tick) + cost(size)
                size = 0
            size += profile.param_bytes[i] if i >= 0 else 0
        tick = max(tick + cycle_s, busy_until)
    return groups


def sweep(
    profile: Profile,
    system: System,
    gpu_counts: Sequence[int],
    policies: Sequence[str] = POLICIES,
    accumulate: int = 1,
    batch: Optional[int] = None,
    cap_mb: Optional[float] = None,
    compression: str = "none",
    sharding: str = "none",
    effects: Effects = FITTED,
) -> List[Dict[str, Any]]:
    """One row per (policy, GPU count), with the fitted Effects unless told
    otherwise (NO_EFFECTS: the communication model alone)."""
    rows = []
    for policy in policies:
        for n in gpu_counts:
            nodes, per_node = system.topology(n)
            s = step(profile, system, n, policy, accumulate, cap_mb, compression, sharding, effects)
            row = {
                "policy": policy,
                "gpus": n,
                "nodes": nodes,
                "gpus_per_node": per_node,
                "step_ms": s.step_s * 1e3,
                "ideal_ms": s.ideal_s * 1e3,
                "efficiency": s.efficiency,
                "exposed_comm_ms": s.exposed_s * 1e3,
                "effects_ms": s.effects_s * 1e3,
                "comm_ms": s.comm_s * 1e3,
                "reductions": s.reductions,
                "algorithms": s.algorithms,
                "compression": compression,
                "sharding": sharding,
            }
            if batch:
                row["samples_per_s"] = n * batch * accumulate / s.step_s
            rows.append(row)
    return rows


def chart(rows: Sequence[Dict[str, Any]], title: str, path: Any) -> Any:
    """Efficiency vs GPU count, one line per policy (PNG)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    # Later lines are dashed or dotted with larger hollow markers, so a line
    # drawn over an equal one leaves it visible; the legend says which are equal.
    styles = [("o", "-", 5), ("s", "--", 7), ("^", ":", 8), ("D", "-.", 9), ("v", "--", 10)]
    curves: Dict[str, List[float]] = {}
    for k, policy in enumerate(dict.fromkeys(r["policy"] for r in rows)):
        mine = [r for r in rows if r["policy"] == policy]
        values = [round(100 * r["efficiency"], 3) for r in mine]
        same = [p for p, v in curves.items() if v == values]
        curves[policy] = values
        marker, line, size = styles[k % len(styles)]
        ax.plot(
            [r["gpus"] for r in mine],
            [100 * r["efficiency"] for r in mine],
            marker=marker,
            linestyle=line,
            markersize=size,
            markerfacecolor="none" if k else None,
            label=policy + (f" (= {same[0]})" if same else ""),
        )
    counts = sorted({r["gpus"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.set_xlabel("GPUs")
    ax.set_ylabel("scaling efficiency, % of one GPU's step rate")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path, 120)
