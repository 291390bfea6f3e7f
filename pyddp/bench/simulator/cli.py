"""`pyddp-bench simulate`'s options and command: a profile (a preset priced
on a GPU's roofline, or a measured one), swept over GPU counts for every
policy (simulate.py), or the published results reproduced (published.py)."""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List

import torch

from .._util import table
from . import costmodel, hardware, published, simulate
from .architectures import PRESETS

_GPUS = "1,2,4,8,16,32,64,128,256"  # the default GPU counts
_DEFAULTS: Dict[str, Any] = {}  # each option's default, to tell what a user gave


def add_options(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--model", choices=sorted(PRESETS), default=None, help="architecture (default: resnet50)"
    )
    s.add_argument(
        "--profile",
        default=None,
        metavar="PATH",
        help="a measured profile (Profile.save / profile_from_timeline); replaces --model's",
    )
    s.add_argument(
        "--hardware", choices=sorted(hardware.SYSTEMS), default="h100-nvlink", help="system"
    )
    s.add_argument("--nics", type=int, default=None, help="NICs per node (default: the system's)")
    s.add_argument(
        "--nic-gbit", type=float, default=None, help="Gbit/s per NIC (default: the system's)"
    )
    counts = s.add_mutually_exclusive_group()
    counts.add_argument(
        "--gpus",
        default=None,
        help=f"GPU counts, comma separated (default: {_GPUS}; with --quick 1,8,64)",
    )
    counts.add_argument(
        "--nodes", default=None, help="node counts, comma separated (full nodes; replaces --gpus)"
    )
    s.add_argument("--batch", type=int, default=None, help="per-GPU batch (default: the model's)")
    s.add_argument(
        "--precision",
        choices=["fp32", "tf32", "amp"],
        default=None,
        help="compute precision (default: amp). fp32 prices matmuls and convolutions on "
        "the FP32 cores; PyTorch runs convolutions in TF32 on A100/H100 unless told not "
        "to: use tf32 for that",
    )
    s.add_argument(
        "--optimizer",
        choices=sorted(costmodel.OPTIMIZER_WORDS),
        default=None,
        help="optimizer step priced after backward (default: the model's usual one)",
    )
    s.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    s.add_argument(
        "--cap-mb",
        type=float,
        default=None,
        help="bucket cap, MiB (default: each engine's, 25 after a 1 MiB first bucket; "
        "given, torch DDP's first bucket is this size too, as in torch)",
    )
    s.add_argument(
        "--compression",
        choices=simulate.COMPRESSIONS,
        default="none",
        help="gradients reduced through torch DDP's fp16/bf16 compression hook (pyddp "
        "runs them too): half the bytes, plus the hook's casts",
    )
    s.add_argument(
        "--sharding",
        choices=simulate.SHARDINGS,
        default="none",
        help="optimizer state sharded over the GPUs: zero1 (ZeRO stage 1 as torch's "
        "ZeroRedundancyOptimizer and DeepSpeed run it: an all-gather of the parameters after "
        "each step) or zero2 (also a reduce-scatter per bucket instead of the all-reduce)",
    )
    s.add_argument(
        "--step-ms",
        type=float,
        default=None,
        help="calibrate: scale the profile so one GPU's step (--accumulate forwards and "
        "backwards, then the optimizer) takes this long, as measured on the real GPU",
    )
    s.add_argument(
        "--validate",
        action="store_true",
        help="reproduce the published results in pyddp/bench/simulator/published.py instead",
    )
    _DEFAULTS.update(vars(s.parse_args([])))  # the common options default to SUPPRESS: absent


_PROFILE_FIXES = ("model", "batch", "precision", "optimizer")  # what a --profile already fixes


def _fail(message: str) -> SystemExit:
    return SystemExit(f"pyddp-bench simulate: {message}")


def run(args: argparse.Namespace, chart_path: Path) -> Dict[str, Any]:
    """The command: the table printed, the chart written; the JSON payload."""
    if args.validate:
        return _validate(args, chart_path)
    system = hardware.SYSTEMS[args.hardware]
    if args.nics is not None or args.nic_gbit is not None:
        system = system.with_network(
            system.nics if args.nics is None else args.nics,
            system.nic_gbit if args.nic_gbit is None else args.nic_gbit,
        )
    counts = _gpu_counts(args, system)  # the options are checked before any work
    batch = None
    if args.profile:
        given = [f"--{o}" for o in _PROFILE_FIXES if getattr(args, o) is not None]
        if given:
            raise _fail(f"{', '.join(given)}: the profile {args.profile} already fixes them")
        try:
            profile = costmodel.Profile.load(args.profile)
        except (OSError, ValueError) as e:
            raise _fail(f"--profile: {e}") from None
        what = f"profile {args.profile} ({profile.source or 'no source given'})"
    else:
        name, precision = args.model or "resnet50", args.precision or "amp"
        try:
            system.gpu.peaks(precision)
        except ValueError as e:
            raise _fail(str(e)) from None
        preset = PRESETS[name]
        batch = args.batch or preset.batch
        optimizer = args.optimizer or preset.optimizer
        try:
            with torch.device("meta"):
                model = preset.build()
            trace = costmodel.record(model, *preset.example(batch))
        except (ImportError, RuntimeError, ValueError) as e:
            raise _fail(f"could not record a step of {name} at batch {batch}: {e}") from None
        profile = costmodel.price(trace, system.gpu, precision, optimizer)
        what = (
            f"{name} ({preset.about}), batch {batch} per GPU, {precision}, "
            f"{optimizer}: {len(trace.ops)} operators, "
            f"{(trace.flops(False) + trace.flops(True)) / 1e12:.2f} TFLOP per step"
        )
    if args.step_ms:
        profile = profile.calibrated(args.step_ms / 1e3, args.accumulate)
    rows = simulate.sweep(
        profile,
        system,
        counts,
        accumulate=args.accumulate,
        batch=batch,
        cap_mb=args.cap_mb,
        compression=args.compression,
        sharding=args.sharding,
    )
    hook = "" if args.compression == "none" else f"; {args.compression} compression hook"
    hook += "" if args.sharding == "none" else f"; optimizer state sharded ({args.sharding})"
    print(f"{what}\n{system.name}; profile: {profile.source}{hook}")
    print(
        f"one GPU: forward {profile.forward_s * 1e3:.2f} ms, backward "
        f"{profile.backward_s * 1e3:.2f} ms, optimizer {profile.optimizer_s * 1e3:.2f} ms; "
        f"{len(profile.param_bytes)} gradients, {sum(profile.param_bytes) / 1e6:.1f} MB"
        + (f"; {args.accumulate} micro-batches per step" if args.accumulate > 1 else "")
    )
    if args.quick:
        print("--quick: fewer GPU counts by default; the figures are the full model's")
    print(
        table(
            [
                "policy",
                "GPUs",
                "nodes",
                "step ms",
                "efficiency",
                "exposed ms",
                "reductions",
                "NCCL",
            ],
            [
                [
                    r["policy"],
                    r["gpus"],
                    r["nodes"],
                    r["step_ms"],
                    f"{100 * r['efficiency']:.1f}%",
                    r["exposed_comm_ms"],
                    r["reductions"],
                    max(r["algorithms"], key=r["algorithms"].get) if r["algorithms"] else "-",
                ]
                for r in rows
            ],
        )
    )
    title = (
        f"{args.profile} on {system.name}"
        if args.profile
        else f"{name}, batch {batch}/GPU, {precision}, on {system.name}"
    )
    print(f"chart {simulate.chart(rows, title, chart_path)}")
    return {"system": asdict(system), "profile": asdict(profile), "rows": rows}


def _gpu_counts(args: argparse.Namespace, system: hardware.System) -> List[int]:
    """Checks the numeric options; the GPU counts to simulate."""
    positive = {
        "--batch": args.batch,
        "--accumulate": args.accumulate,
        "--step-ms": args.step_ms,
        "--nics": args.nics,
        "--nic-gbit": args.nic_gbit,
    }
    for option, value in positive.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            raise _fail(f"{option} {value}: must be a positive number")
    if args.cap_mb is not None and not (math.isfinite(args.cap_mb) and args.cap_mb >= 0):
        raise _fail(f"--cap-mb {args.cap_mb}: must be >= 0 (0: one bucket per parameter)")
    text = args.nodes or args.gpus or ("1,8,64" if args.quick else _GPUS)
    try:
        counts = sorted({int(n) for n in text.split(",") if n.strip()})
    except ValueError:
        raise _fail(f"{text!r}: give whole numbers, comma separated") from None
    if args.nodes:
        counts = [n * system.gpus_per_node for n in counts]
    try:
        if not counts or min(counts) < 1:
            raise ValueError(f"GPU counts must be >= 1, got {counts}")
        for n in counts:
            system.topology(n)  # whole nodes beyond one
    except ValueError as e:
        raise _fail(str(e)) from None
    return counts


def _validate(args: argparse.Namespace, chart_path: Path) -> Dict[str, Any]:
    given = [
        "--" + k.replace("_", "-")
        for k, v in vars(args).items()
        if k in _DEFAULTS and k != "validate" and v != _DEFAULTS[k]
    ]
    if given:
        raise _fail(f"--validate runs each publication's own setup: drop {', '.join(given)}")
    rows = published.run()
    print(
        "published vs predicted scaling efficiency, each from the publication's own setup "
        "(predicted: compute\nscaled to the publication's base rate; roofline: uncalibrated)"
    )
    print(
        table(
            ["case", "GPUs", "published", "predicted", "error pts", "roofline", "per-GPU pub/roof"],
            [
                [
                    r["case"],
                    f"{r['baseline_gpus']}->{r['gpus']}",
                    f"{100 * r['published']:.1f}%",
                    f"{100 * r['predicted']:.1f}%",
                    f"{r['error_points']:+.1f}",
                    f"{100 * r['predicted_roofline']:.1f}%",
                    f"{r['one_gpu_published_per_s']:.0f}/{r['one_gpu_roofline_per_s']:.0f}",
                ]
                for r in rows
            ],
        )
    )
    print(f"chart {published.chart(rows, chart_path)}")
    return {"rows": rows}
