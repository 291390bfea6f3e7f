"""`pyddp-bench {allreduce,overlap,simulate}`: see each module's docstring.
Every command prints a table, writes JSON (and overlap a PNG chart) into
--out, and has --quick for a smoke run of a few seconds."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch

import pyddp

from . import allreduce, overlap, simulate
from ._util import machine, make_input, make_model, table, write_json


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="pyddp-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="pyddp-bench-results", help="folder for JSON/PNG")
    parser.add_argument("--quick", action="store_true", help="a few-second smoke run")
    parser.add_argument("--no-progress", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    a = sub.add_parser("allreduce", help="all-reduce bandwidth table vs a memory copy")
    a.add_argument("--devices", nargs="+", default=["cpu", "cpu"])
    a.add_argument("--min-bytes", type=_size, default=_size("1K"))
    a.add_argument("--max-bytes", type=_size, default=_size("256M"))
    a.add_argument("--factor", type=int, default=4)
    a.add_argument("--dtype", choices=sorted(allreduce.DTYPES), default="float32")
    a.add_argument("--reps", type=int, default=15)

    for name, helptext in (
        ("overlap", "step time and overlap vs baselines and torch DDP"),
        ("simulate", "alpha-beta prediction for n devices"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--model", choices=["mlp", "conv", "transformer"], default="mlp")
        p.add_argument("--width", type=int, default=1024)
        p.add_argument("--depth", type=int, default=6)
        p.add_argument("--batch", type=int, default=128)
        p.add_argument("--devices", nargs="+", default=["cpu", "cpu"])
        p.add_argument("--caps", default="1,25", help="bucket caps in MiB, comma separated")
    o = sub.choices["overlap"]
    o.add_argument("--rounds", type=int, default=10)
    o.add_argument("--steps", type=int, default=3)
    o.add_argument("--no-ddp", action="store_true", help="skip the torch DDP processes")
    s = sub.choices["simulate"]
    s.add_argument("--link", choices=sorted(simulate.LINKS), default="nvlink-h100")
    s.add_argument("--alpha-us", type=float, default=None)
    s.add_argument("--beta-gbps", type=float, default=None, help="GB/s per direction")
    s.add_argument("--n", default="2,4,8,16,64", help="device counts, comma separated")

    args = parser.parse_args(argv)
    out = Path(args.out)
    suffix = "-quick" if args.quick else ""
    progress = not args.no_progress
    header = (
        f"pyddp {pyddp.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(header)

    if args.command == "allreduce":
        max_bytes = min(args.max_bytes, _size("64K")) if args.quick else args.max_bytes
        sizes = allreduce.sizes(args.min_bytes, max_bytes, args.factor)
        rows = allreduce.run(
            args.devices, sizes, args.dtype, 3 if args.quick else args.reps, progress
        )
        print(f"all-reduce over {args.devices} ({args.dtype}), reference: memory copy, same run")
        print(
            table(
                [
                    "bytes",
                    "count",
                    "dtype",
                    "time us",
                    "p10",
                    "p90",
                    "algbw GB/s",
                    "busbw GB/s",
                    "copy GB/s",
                    "algbw/copy",
                ],
                [
                    [
                        r["bytes"],
                        r["count"],
                        r["dtype"],
                        r["time_s"]["median"] * 1e6,
                        r["time_s"]["p10"] * 1e6,
                        r["time_s"]["p90"] * 1e6,
                        r["algbw_GBps"],
                        r["busbw_GBps"],
                        r["copy_GBps"],
                        r["algbw_over_copy"],
                    ]
                    for r in rows
                ],
            )
        )
        path = write_json(
            out / f"allreduce{suffix}.json",
            {"machine": machine(), "devices": args.devices, "rows": rows},
        )
        print(f"wrote {path}")
        return 0

    caps = [float(c) for c in args.caps.split(",") if c]
    width, depth, batch = args.width, args.depth, args.batch
    if args.quick:
        width, depth, batch = min(width, 64), min(depth, 2), min(batch, 16)

    if args.command == "overlap":
        rounds, steps = (2, 1) if args.quick else (args.rounds, args.steps)
        result = overlap.run(
            args.model,
            width,
            depth,
            batch,
            args.devices,
            caps,
            rounds,
            steps,
            ddp=not args.no_ddp,
            progress=progress,
        )
        rows = []
        for r in result["results"]:
            rows.append(
                [
                    r["variant"],
                    r["step_s"]["median"] * 1e3,
                    r["step_s"]["p10"] * 1e3,
                    r["step_s"]["p90"] * 1e3,
                    r["over_lower_bound"],
                    "-" if r["overlap_fraction"] is None else f"{100 * r['overlap_fraction']:.0f}%",
                    "-" if r["exposed_comm_s"] is None else r["exposed_comm_s"] * 1e3,
                ]
            )
        print(f"{args.model} width {width} depth {depth}, global batch {batch}, on {args.devices}")
        print(
            table(
                ["variant", "step ms", "p10", "p90", "/lower bound", "overlap", "exposed comm ms"],
                rows,
            )
        )
        result["machine"] = machine()
        path = write_json(out / f"overlap{suffix}.json", result)
        png = _chart(result, out / f"overlap{suffix}.png")
        print(f"wrote {path} and {png}")
        return 0

    # simulate
    alpha, beta = simulate.LINKS[args.link]
    alpha = alpha if args.alpha_us is None else args.alpha_us * 1e-6
    beta = beta if args.beta_gbps is None else args.beta_gbps * 1e9
    profile = measure_profile(args.model, width, depth, batch, args.devices)
    counts = [int(n) for n in args.n.split(",") if n]
    rows = simulate.table_rows(profile, counts, alpha, beta, [0.0, *caps])
    print(
        f"measured here: forward {profile.forward_s * 1e3:.2f} ms, backward "
        f"{profile.backward_s * 1e3:.2f} ms, {sum(profile.param_bytes) / 1e6:.1f} MB of "
        f"gradients; link {args.link}: alpha {alpha * 1e6:g} us, beta {beta / 1e9:g} GB/s"
    )
    print(
        table(
            [
                "cap MiB",
                "devices",
                "buckets",
                "step overlap ms",
                "step no-overlap ms",
                "eff. overlap",
                "eff. no overlap",
            ],
            [
                [
                    r["cap_mb"],
                    r["devices"],
                    r["buckets"],
                    r["step_overlap_s"] * 1e3,
                    r["step_no_overlap_s"] * 1e3,
                    r["efficiency_overlap"],
                    r["efficiency_no_overlap"],
                ]
                for r in rows
            ],
        )
    )
    path = write_json(
        out / f"simulate{suffix}.json",
        {
            "machine": machine(),
            "link": args.link,
            "alpha_s": alpha,
            "beta_Bps": beta,
            "profile": profile.__dict__,
            "rows": rows,
        },
    )
    print(f"wrote {path}")
    return 0


def measure_profile(
    model: str, width: int, depth: int, batch: int, devices: List[str], iterations: int = 5
) -> simulate.Profile:
    """Per-parameter ready times of a real backward on this machine (per-parameter
    mode with the timeline on), the median iteration of a few."""
    dm = pyddp.wrap(make_model(model, width, depth), devices, bucket_cap_mb=0, timeline=1)
    x, y = make_input(model, width, batch)
    samples = []
    for _ in range(iterations):
        start = time.perf_counter_ns()
        out = dm(x)
        forward_ns = time.perf_counter_ns() - start
        torch.nn.functional.cross_entropy(out, y).backward()
        dm.zero_grad()
        t = dm.sync.observer.timelines[-1]
        raw = t["raw"]
        begin = raw["forward_end_ns"]
        ready = [0.0] * len(dm.sync.names)
        for b, members in enumerate(dm.sync.buckets):
            ready[members[0]] = max(0, t["bucket_ready_ns"][b] - begin) / 1e9
        samples.append((forward_ns / 1e9, (raw["finish_start_ns"] - begin) / 1e9, ready))
    samples.sort(key=lambda s: s[1])
    forward_s, backward_s, ready = samples[len(samples) // 2]
    sizes = [p.numel() * p.element_size() for p in dm.sync.params[0]]
    dm.close()
    return simulate.Profile(forward_s, backward_s, sizes, ready)


def _chart(result, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    ax.set_title(
        f"pyddp overlap: {cfg['model']} w{cfg['width']} d{cfg['depth']}, "
        f"batch {cfg['batch']}, {len(cfg['devices'])} replicas"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
