"""`pyddp-bench simulate`'s options and command: a profile (a preset priced
on a GPU's roofline, or a measured one), swept over GPU counts for every
policy (simulate.py), or the published results reproduced (published.py)."""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch

from .._util import table
from . import costmodel, hardware, nccl_tests, published, simulate
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
        help="optimizer state sharded over the GPUs: zero1 (ZeRO stage 1, pyddp's shard=True, "
        "as torch's ZeroRedundancyOptimizer: an all-gather of the parameters after each step) "
        "or zero2 (pyddp's shard='gradients': also a reduce-scatter per bucket instead of the "
        "all-reduce)",
    )
    s.add_argument(
        "--policy",
        action="append",
        choices=simulate.POLICIES + simulate.MORE_POLICIES,
        default=None,
        help="simulate only this policy (repeat for several; default: the five compared). "
        "Also: horovod (Tensor Fusion, 64 MB every 5 ms plus its negotiation), one all-reduce "
        "(one flat reduction after backward), and pyddp's plan with taper_buckets=True",
    )
    s.add_argument(
        "--grad-dtype",
        choices=["float32", "float16"],
        default=None,
        help="the dtype gradients are reduced in (float16: half the bytes, as NVIDIA's BERT "
        "reduces them; default: the parameters')",
    )
    s.add_argument(
        "--no-effects",
        action="store_true",
        help="the communication model alone: leave out the fitted per-step overhead, NCCL's "
        "slowing of the compute it overlaps, and stragglers (simulate.FITTED)",
    )
    s.add_argument(
        "--step-ms",
        type=float,
        default=None,
        help="calibrate: scale the profile so one GPU's step (--accumulate forwards and "
        "backwards, then the optimizer) takes this long, as measured on the real GPU",
    )
    s.add_argument(
        "--step-policy",
        choices=simulate.POLICIES + simulate.MORE_POLICIES,
        default=None,
        help="with --step-ms at several GPUs: the policy the measured step ran under (a "
        "step measured with torch DDP: 'torch DDP'; default: the first --policy, 'no "
        "overlap' without one)",
    )
    s.add_argument(
        "--step-gpus",
        type=int,
        default=None,
        help="with --step-ms: the GPU count the step was measured at (default 1; e.g. 8 "
        "for a measurement on one node: its communication is then the model's)",
    )
    s.add_argument(
        "--compare-plans",
        action="store_true",
        help="the bucket plans side by side (pyddp's with and without taper_buckets=True, torch "
        "DDP's two) for every preset at 8, 64 and 256 GPUs of --hardware (to simulate-plans.json)",
    )
    s.add_argument(
        "--validate",
        action="store_true",
        help="reproduce the published results in pyddp/bench/simulator/cases.py instead, "
        "with the fit half's cross-validation and the band it gives",
    )
    _DEFAULTS.update(vars(s.parse_args([])))  # the common options default to SUPPRESS: absent


_PROFILE_FIXES = ("model", "batch", "precision", "optimizer")  # what a --profile already fixes


def _fail(message: str) -> SystemExit:
    return SystemExit(f"pyddp-bench simulate: {message}")


def run(args: argparse.Namespace, chart_path: Path) -> Dict[str, Any]:
    """The command: the table printed, the chart written; the JSON payload."""
    if args.validate:
        return _validate(args, chart_path)
    if args.compare_plans:
        return _compare_plans(args)
    system = hardware.SYSTEMS[args.hardware]
    counts = _gpu_counts(args, system)  # the options are checked before any work
    if args.nics is not None or args.nic_gbit is not None:
        system = system.with_network(
            system.nics if args.nics is None else args.nics,
            system.nic_gbit if args.nic_gbit is None else args.nic_gbit,
        )
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
    if args.grad_dtype == "float16":
        if any("16" in d for d in profile.dtypes or []):
            raise _fail("--grad-dtype float16: this profile's gradients are 16-bit already")
        profile = replace(
            profile,
            param_bytes=[b // 2 for b in profile.param_bytes],
            dtypes=["float16"] * len(profile.param_bytes),
        )
    effects = simulate.NO_EFFECTS if args.no_effects else simulate.FITTED
    policies = tuple(dict.fromkeys(args.policy)) if args.policy else simulate.POLICIES
    if args.step_ms:
        gpus = args.step_gpus or 1
        try:
            system.topology(gpus)
            under = args.step_policy or policies[0]
            profile = published.calibrated_at(
                profile, system, gpus, under, args.accumulate, args.step_ms / 1e3, effects
            )
        except ValueError as e:
            raise _fail(f"--step-ms {args.step_ms} at {gpus} GPUs: {e}") from None
    try:  # (what the options cannot check alone: a 16-bit profile compressed)
        rows = simulate.sweep(profile, system, counts, policies, accumulate=args.accumulate,
                              batch=batch, cap_mb=args.cap_mb, compression=args.compression,
                              sharding=args.sharding, effects=effects)  # fmt: skip
    except ValueError as e:
        raise _fail(str(e)) from None
    band = None if args.no_effects else simulate.BAND
    if band:
        for r in rows:
            r["band_low"], r["band_high"] = band.around(r["efficiency"])
    hook = "" if args.compression == "none" else f"; {args.compression} compression hook"
    hook += "" if args.sharding == "none" else f"; optimizer state sharded ({args.sharding})"
    hook += "; communication model alone" if args.no_effects else "; with simulate.FITTED effects"
    print(f"{what}\n{system.name}; profile: {profile.source}{hook}")
    print(
        f"one GPU: forward {profile.forward_s * 1e3:.2f} ms, backward "
        f"{profile.backward_s * 1e3:.2f} ms, optimizer {profile.optimizer_s * 1e3:.2f} ms; "
        f"{len(profile.param_bytes)} gradients, {sum(profile.param_bytes) / 1e6:.1f} MB"
        + (f"; {args.accumulate} micro-batches per step" if args.accumulate > 1 else "")
    )
    if args.quick:
        print("--quick: fewer GPU counts by default; the figures are the full model's")
    if band:
        print(
            f"band: where {band.coverage:.0%} of published efficiencies fell around out-of-sample "
            f"predictions (simulate.BAND: {band.below:g} points under to {band.above:g} over)"
        )
    print(
        table(
            ["policy", "GPUs", "nodes", "step ms", "efficiency"]
            + ([f"{band.coverage:.0%} band"] if band else [])
            + ["exposed ms", "reductions", "NCCL"],
            [
                [r["policy"], r["gpus"], r["nodes"], r["step_ms"], f"{100 * r['efficiency']:.1f}%"]
                + ([_band_cell(r)] if band else [])
                + [
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


def _band_cell(row: Dict[str, Any]) -> str:
    """The band's cell: none on one GPU, where nothing is predicted."""
    if row["gpus"] == 1:
        return "-"
    return f"{100 * row['band_low']:.0f}-{100 * row['band_high']:.0f}%"


def _compare_plans(args: argparse.Namespace) -> Dict[str, Any]:
    """Every preset's efficiency at 8, 64 and 256 GPUs under each bucket plan."""
    given = [
        "--" + k.replace("_", "-")
        for k, v in vars(args).items()
        if k in _DEFAULTS and k not in ("compare_plans", "hardware") and v != _DEFAULTS[k]
    ]
    if given:
        raise _fail(f"--compare-plans runs every preset at its defaults: drop {', '.join(given)}")
    system = hardware.SYSTEMS[args.hardware]
    rows = plan_table(system)
    print(f"bucket plans on {system.name}, each preset at its default batch, amp, fitted effects")
    print(markdown_plans(rows))
    return {"system": asdict(system), "rows": rows}


def plan_table(
    system: hardware.System, counts: Sequence[int] = (8, 64, 256)
) -> List[Dict[str, Any]]:
    """One row per (preset, GPU count): efficiency under each of simulate.PLANS."""
    rows = []
    for name, preset in PRESETS.items():
        with torch.device("meta"):
            model = preset.build()
        trace = costmodel.record(model, *preset.example(preset.batch))
        profile = costmodel.price(trace, system.gpu, "amp", preset.optimizer)
        for n in counts:
            row: Dict[str, Any] = {"model": name, "gpus": n}
            for plan in simulate.PLANS:
                s = simulate.step(profile, system, n, plan, effects=simulate.FITTED)
                row[plan] = s.efficiency
            rows.append(row)
    return rows


def markdown_plans(rows: Sequence[Dict[str, Any]]) -> str:
    head = " | ".join(simulate.PLANS)
    lines = [f"| model | GPUs | {head} |", "|---|---|" + "---|" * len(simulate.PLANS)]
    for r in rows:
        best = max(r[p] for p in simulate.PLANS)
        cells = []
        for p in simulate.PLANS:
            text = f"{100 * r[p]:.2f}%"
            cells.append(f"**{text}**" if round(r[p], 4) == round(best, 4) else text)
        lines.append(f"| {r['model']} | {r['gpus']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _gpu_counts(args: argparse.Namespace, system: hardware.System) -> List[int]:
    """Checks the numeric options; the GPU counts to simulate."""
    positive = {
        "--batch": args.batch,
        "--accumulate": args.accumulate,
        "--step-ms": args.step_ms,
        "--step-gpus": args.step_gpus,
        "--nics": args.nics,
        "--nic-gbit": args.nic_gbit,
    }
    for option, value in positive.items():
        if value is not None and not (math.isfinite(value) and value > 0):
            raise _fail(f"{option} {value}: must be a positive number")
    if args.step_gpus is not None and args.step_ms is None:
        raise _fail("--step-gpus says where --step-ms was measured: give --step-ms too")
    if args.step_policy is not None and args.step_ms is None:
        raise _fail("--step-policy says how --step-ms was measured: give --step-ms too")
    if args.cap_mb is not None and args.cap_mb > 2**40:  # (bytes past int64 in the planner)
        raise _fail(f"--cap-mb {args.cap_mb}: at most 2**40 (one bucket takes every parameter)")
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
        "published vs predicted scaling efficiency, each from the publication's own setup\n"
        "(predicted: compute scaled to the publication's base rate, with simulate.FITTED "
        "effects;\ncomm only: without them; half: the split of published.held_out())"
    )
    print(
        table(
            ["case", "half", "GPUs", "published", "predicted", "error pts", "comm only"],
            [
                [
                    r["case"],
                    r["half"],
                    f"{r['baseline_gpus']}->{r['gpus']}",
                    f"{100 * r['published']:.1f}%",
                    f"{100 * r['predicted']:.1f}%",
                    f"{r['error_points']:+.1f}",
                    f"{100 * r['predicted_comm_only']:.1f}%",
                ]
                for r in rows
            ],
        )
    )
    cv = published.cross_validate()
    band = published.band(cv)
    summary = published.summary(rows, cv, band)
    print(
        f"\nthe band: in {band.coverage:.0%} of the fit half's out-of-sample predictions (each "
        f"case predicted by effects fitted without it), the published efficiency lay between "
        f"{band.below:g} points under the prediction and {band.above:g} over it"
    )
    print(published.markdown_summary(summary, band))
    checks = nccl_tests.compare()
    print("\nthe all-reduce model against published nccl-tests times (nccl_tests.py)")
    print(nccl_tests.markdown(checks))
    print(f"chart {published.chart(rows, chart_path)}")
    return {
        "rows": rows,
        "summary": summary,
        "cross_validation": cv,
        "band": asdict(band),
        "nccl_tests": checks,
    }
