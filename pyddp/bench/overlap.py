"""`pyddp-bench overlap`: one training step (forward, loss, backward,
zero_grad; the optimizer step is left out: it is identical in every variant and
unrelated to communication) under
  no reduction      - pyddp under no_sync(): the lower bound
  after backward    - every reduction after backward (no overlap)
  per-parameter     - pyddp, one bucket per parameter
  bucketed cap X    - pyddp, buckets of X MiB
  torch DDP         - gloo (CPU) / NCCL (GPU), one spawned process per replica
Step-time medians with p10-p90, ratios to the lower bound, overlap and exposed
communication from pyddp's own statistics. DataParallel does not run on CPU
replicas and is left out there.

With --processes N (N > 1): pyddp across N processes (1 CPU replica each,
started through torchrun) against torch DDP (gloo) in the same processes,
interleaved; step time, the ratio pyddp / DDP, overlap for both and the cost
of the per-step agreement across processes (see pyddp.bench.multiproc).

The lower bound is measured in the same run, interleaved with the others, not
computed: it carries the same noise, so a variant whose reductions cost less
than that noise (a tiny model, as with --quick) can come out below it. A ratio
whose median lies inside the bound's p10-p90 is marked as such."""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import pyddp

from ._util import make_input, make_model, pyplot, rotated, save_figure, summary


def _variants(caps: List[float]) -> List[Dict[str, Any]]:
    out = [
        {"name": "no reduction", "wrap": {}, "no_sync": True},
        {"name": "after backward", "wrap": {"reduce_order": "after_backward"}},
        {"name": "per-parameter", "wrap": {"bucket_cap_mb": 0}},
    ]
    out += [{"name": f"bucketed {c:g} MiB", "wrap": {"bucket_cap_mb": c}} for c in caps]
    return out


def run(
    model: str,
    width: int,
    depth: int,
    batch: int,
    devices: List[str],
    caps: List[float],
    rounds: int,
    steps: int,
    ddp: bool,
    progress: bool = True,
) -> Dict[str, Any]:
    x, y = make_input(model, width, batch)
    cases = []
    for v in _variants(caps):
        dm = pyddp.wrap(make_model(model, width, depth), devices, **v["wrap"])
        cases.append((v, dm))
    times: Dict[str, List[float]] = {v["name"]: [] for v, _ in cases}
    bar = tqdm(total=rounds * len(cases), desc="overlap rounds", disable=not progress, leave=False)
    # Round 0 is warm-up (thread pools, allocator, first-call costs): untimed,
    # or it lands on whichever variant goes first, the lower bound included.
    for r in range(rounds + 1):
        for v, dm in rotated(cases, r):  # no variant always follows the same one
            ctx = dm.no_sync if v.get("no_sync") else contextlib.nullcontext
            step = _step(dm, x, y, ctx)
            step()  # untimed: brings this variant's weights back into cache
            start = time.perf_counter()
            for _ in range(steps):
                step()
            if r:
                times[v["name"]].append((time.perf_counter() - start) / steps)
                bar.update(1)
            else:  # pyddp's means (overlap, communication) leave the warm-up out too (a probe)
                dm.reset_stats()
    bar.close()
    bound = summary(times["no reduction"])
    results = []
    for v, dm in cases:
        s = summary(times[v["name"]])
        mean = dm.stats().get("mean", {}) if not v.get("no_sync") else {}
        results.append(
            {
                "variant": v["name"],
                "step_s": s,
                "samples_s": times[v["name"]],
                "over_lower_bound": s["median"] / bound["median"],
                "within_bound_spread": _within(s, bound),
                "overlap_fraction": mean.get("overlap_fraction"),
                "comm_s": mean.get("comm_s"),
                "exposed_comm_s": mean.get("exposed_comm_s"),
                "buckets": dm.stats()["buckets"],
                # GPU replicas: host against GPU time, and whether the host bounds the step
                "gpu": dm.stats().get("gpu"),
                "gpu_advice": dm.stats().get("gpu_advice"),
            }
        )
        dm.close()
    if ddp and len(devices) > 1:
        s = run_ddp(model, width, depth, batch, devices, rounds, steps)
        results.append(
            {
                "variant": "torch DDP",
                "step_s": s,
                "over_lower_bound": s["median"] / bound["median"],
                "within_bound_spread": _within(s, bound),
                "overlap_fraction": None,
                "comm_s": None,
                "exposed_comm_s": None,
                "buckets": None,
            }
        )
    return {
        "config": {
            "model": model,
            "width": width,
            "depth": depth,
            "batch": batch,
            "devices": devices,
            "rounds": rounds,
            "steps": steps,
        },
        "results": results,
    }


def _within(s: Dict[str, float], bound: Dict[str, float]) -> bool:
    """Whether the variant's median lies inside the lower bound's p10-p90: the
    bound is measured, not computed, so a ratio near 1 there is noise, whichever
    side of 1 it falls."""
    return bound["p10"] <= s["median"] <= bound["p90"]


def _step(dm: pyddp.DistributedModel, x, y, ctx: Callable) -> Callable[[], None]:
    def step() -> None:
        with ctx():
            dm.loss(F.cross_entropy, x, y).backward()
        dm.zero_grad()

    return step


def run_ddp(
    model: str, width: int, depth: int, batch: int, devices: List[str], rounds: int, steps: int
) -> Dict[str, float]:
    """torch DDP with one process per replica at the same global batch (an
    odd one split as pyddp splits it); rank 0's step times, each sample the
    mean of `steps` steps, as the other variants' (after them, not
    interleaved with them: its own processes)."""
    import torch.multiprocessing as mp

    world = len(devices)
    threads = max(1, torch.get_num_threads() // world)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [
            ctx.Process(
                target=_ddp_rank,
                args=(
                    r,
                    world,
                    os.path.join(tmp, "init"),
                    model,
                    width,
                    depth,
                    batch,
                    devices[r],
                    rounds * steps,
                    threads,
                    queue,
                ),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        result = queue.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
    if isinstance(result, str):
        raise RuntimeError(f"torch DDP run failed: {result}")
    return summary([statistics.fmean(result[i : i + steps]) for i in range(0, len(result), steps)])


def _ddp_rank(rank, world, init_file, model, width, depth, batch, device, steps, threads, queue):
    import torch.distributed as dist

    try:
        torch.set_num_threads(threads)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world
        )
        net = make_model(model, width, depth).to(device)
        ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=None)
        x, y = make_input(model, width, batch)
        # (every row, as pyddp's replicas take them: an odd batch split unevenly)
        xs, ys = x.tensor_split(world)[rank].to(device), y.tensor_split(world)[rank].to(device)
        times = []
        for i in range(steps + 2):
            start = time.perf_counter()
            F.cross_entropy(ddp(xs), ys).backward()
            ddp.zero_grad()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - start)
        if rank == 0:
            queue.put(times)
        dist.destroy_process_group()
    except Exception as e:  # reported to the parent, which raises
        if rank == 0:
            queue.put(f"{type(e).__name__}: {e}")


def chart(result: Dict[str, Any], path: Path) -> Path:
    """Bar chart of the step-time medians with p10-p90 whiskers."""
    plt = pyplot()
    rows = result["results"]
    names = [r["variant"] for r in rows]
    med = [r["step_s"]["median"] * 1e3 for r in rows]
    low = [m - r["step_s"]["p10"] * 1e3 for m, r in zip(med, rows)]
    high = [r["step_s"]["p90"] * 1e3 - m for m, r in zip(med, rows)]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    ax.barh(names, med, xerr=[low, high], color="C0", capsize=3)
    ax.invert_yaxis()
    ax.set_xlabel("step time, ms (median, p10-p90)")
    cfg = result["config"]
    if "processes" in cfg:  # pyddp.bench.multiproc's results
        where = f"{cfg['processes']} processes x 1 replica"
    else:
        where = f"{len(cfg['devices'])} replicas"
    ax.set_title(
        f"pyddp overlap: {cfg['model']} w{cfg['width']} d{cfg['depth']}, "
        f"batch {cfg['batch']}, {where}"
    )
    fig.tight_layout()
    return save_figure(fig, path, 110)
