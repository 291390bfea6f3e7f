"""pyddp-bench: measure and predict data-parallel communication.

  allreduce  all-reduce bandwidth over --devices, nccl-tests style, next to a
             memory copy measured in the same run (a table and JSON)
  overlap    one training step under each sync policy (no reduction, after
             backward, per-parameter, bucketed) and torch DDP; --processes N
             across N processes (a table, JSON and a PNG chart)
  simulate   a step on 1 to hundreds of GPUs predicted from a model's profile,
             without a GPU, for each policy (a table, JSON and a PNG chart)

`pyddp-bench SUB --help` shows each one's options and defaults. Results go
to --out; --quick is a smoke run of a few seconds. The common options go
after the subcommand (`pyddp-bench overlap --quick`) or before it."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

import pyddp

from ..runtime.devices import parse_devices
from ..runtime.writing import refusal
from ..train.files import output_root
from . import allreduce, multiproc, overlap
from ._util import busy_note, cpu_busy, machine, model_size, table, write_json
from .simulator import cli as simulator_cli
from .simulator import simulate

_OUT = output_root("bench")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help (but for flags, and None, where the
    help says what happens); the module docstrings that describe each
    subcommand keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False:
            return action.help or ""
        return super()._get_help_string(action)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except (OverflowError, ValueError):  # (1e400G; "12x")
        raise argparse.ArgumentTypeError(
            f"a size in bytes (e.g. 4096, 64K, 1M), got {text!r}"
        ) from None


def _at_least(low: int) -> Any:
    """An argparse type: an int >= low."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"  # argparse's "invalid int value" for text that is no int
    return parse


def _bytes(text: str) -> int:
    value = _size(text)
    if not 1 <= value <= _MEMORY:
        raise argparse.ArgumentTypeError(f"must be 1 byte to this machine's memory, got {text}")
    return value


_MEMORY = (  # the largest buffer that could run: this machine's memory
    os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 1 << 50
)


def _common(parser: argparse.ArgumentParser, top: bool) -> None:
    """The options every subcommand takes. On the top-level parser they carry
    the defaults; on a subcommand they default to SUPPRESS, so a value given
    before the subcommand is not overwritten by the subcommand's default."""

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    parser.add_argument(
        "--out", default=default(_OUT), help=f"folder for the JSON/PNG results (default: {_OUT})"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        default=default(False),
        help="a smoke run (tiny sizes, few samples or fewer points): checks the command; "
        "do not read its figures as results",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        default=default(False),
        help="no progress bar (for logs and CI)",
    )


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        choices=["mlp", "mlp_bn", "conv", "transformer"],
        default="mlp",
        help="model to train (mlp_bn: BatchNorm1d after each hidden layer)",
    )
    p.add_argument("--width", type=_at_least(1), default=1024, help="hidden width (conv: channels)")
    p.add_argument("--depth", type=_at_least(1), default=6, help="hidden layers")
    p.add_argument("--batch", type=_at_least(1), default=128, help="global batch (all replicas)")
    p.add_argument(
        "--devices", nargs="+", default=["cpu", "cpu"], metavar="DEVICE", help="one per replica"
    )
    p.add_argument("--caps", default="1,25", help="bucket caps in MiB, comma separated")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyddp-bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, module: Any, helptext: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name, help=helptext, description=module.__doc__, formatter_class=_Formatter
        )
        _common(p, top=False)
        return p

    a = add("allreduce", allreduce, "all-reduce bandwidth table vs a memory copy")
    a.add_argument(
        "--devices",
        nargs="+",
        default=["cpu", "cpu"],
        metavar="DEVICE",
        help="devices to reduce over",
    )
    a.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="reduce over the first N of --devices, for each N given (default: all of them)",
    )
    a.add_argument("--min-bytes", type=_bytes, default="1K", help="smallest buffer per replica")
    a.add_argument("--max-bytes", type=_bytes, default="256M", help="largest buffer per replica")
    a.add_argument("--factor", type=_at_least(2), default=4, help="size step between rows")
    a.add_argument("--dtype", choices=sorted(allreduce.DTYPES), default="float32", help="dtype")
    a.add_argument("--op", choices=["sum", "avg"], default="avg", help="reduction")
    a.add_argument("--reps", type=_at_least(1), default=15, help="timed samples per size and op")

    o = add("overlap", overlap, "step time and overlap vs baselines and torch DDP")
    _model_options(o)
    o.add_argument("--rounds", type=_at_least(1), default=10, help="timed samples per variant")
    o.add_argument("--steps", type=_at_least(1), default=3, help="steps per sample")
    o.add_argument("--no-ddp", action="store_true", help="skip the torch DDP processes")
    multiproc.add_options(o)

    simulator_cli.add_options(add("simulate", simulate, "predicted efficiency on 1 to 256+ GPUs"))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("allreduce", "overlap"):
        try:  # a device this machine lacks: a usage error, before anything runs
            parse_devices(args.devices)
        except (TypeError, ValueError) as e:
            parser.error(f"{args.command} --devices: {e}")
    if args.command == "allreduce":
        args.replicas = list(dict.fromkeys(args.replicas or [len(args.devices)]))  # (once each)
        bad = [n for n in args.replicas if not 1 <= n <= len(args.devices)]
        if bad:
            parser.error(
                f"allreduce --replicas {bad}: each must be 1..{len(args.devices)}, "
                "the number of --devices"
            )
        most = min(args.max_bytes, _size("64K")) if args.quick else args.max_bytes
        if most < args.min_bytes:
            quick = args.quick and args.max_bytes > _size("64K")  # (the limit that applied)
            below = "--quick's 64K" if quick else f"--max-bytes {args.max_bytes}"
            parser.error(f"allreduce {below} is below --min-bytes {args.min_bytes}")
    if args.command == "overlap":
        multiproc.check_overlap_args(parser, args)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        parser.error(f"--out {args.out}: exists and is not a folder")
    try:  # before the work, not after it
        Path(args.out).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()
    except OSError as e:
        parser.error(f"--out {args.out}: cannot make the folder or write there ({e.strerror or e})")
    result = _path(args, _result_name(args))
    charts = args.command != "allreduce" and not getattr(args, "compare_plans", False)
    for taken in (result, result.with_suffix(".png"))[: 1 + charts]:  # (what it will write)
        why = refusal(taken)  # (a read-only one was refused after the work: a probe)
        if why is not None:
            parser.error(f"--out {args.out}: {taken.name} {why}, where results go (move it)")
    # Before anything of ours runs: other work on the machine makes measured
    # figures noisy. simulate measures nothing (it computes), so it is not asked.
    command = {"allreduce": _allreduce, "overlap": _overlap, "simulate": _simulate}
    try:  # (from here: its half-second CPU sample raised a traceback on a Ctrl-C, a probe)
        busy = cpu_busy() if args.command != "simulate" else None
        load = f", CPU busy before start {busy:.0%}{busy_note(busy)}" if busy is not None else ""
        print(
            f"pyddp {pyddp.__version__}, torch {torch.__version__}, {torch.get_num_threads()} "
            f"threads{load}"
        )
        payload = command[args.command](args)
    except KeyboardInterrupt:  # (one line, not a traceback; the measuring processes are gone)
        print(f"pyddp-bench {args.command}: interrupted, no results written", file=sys.stderr)
        return 130
    path = _path(args, _result_name(args))
    info = {**machine(), "cpu_busy_before_start": busy}
    write_json(path, {"args": vars(args), "machine": info, **payload})
    print(f"wrote {path}")
    return 0


def _result_name(args: argparse.Namespace) -> str:
    """The results' file name: the multi-process mode's never overwrite the others'."""
    if args.command == "overlap" and args.processes > 1:
        return f"overlap-{args.processes}proc"
    if args.command == "simulate" and args.validate:
        return "simulate-validation"
    if args.command == "simulate" and args.compare_plans:  # (another table: another file)
        return "simulate-plans"
    return args.command


def _path(args: argparse.Namespace, name: str) -> Path:
    """<out>/<name>.json, or <name>-quick.json so that a smoke run never
    overwrites the figures of a real one."""
    return Path(args.out) / f"{name}{'-quick' if args.quick else ''}.json"


def _allreduce(args: argparse.Namespace) -> Dict[str, Any]:
    max_bytes = min(args.max_bytes, _size("64K")) if args.quick else args.max_bytes
    sizes = allreduce.sizes(args.min_bytes, max_bytes, args.factor)
    reps = 3 if args.quick else args.reps
    rows = allreduce.run(
        args.devices, args.replicas, sizes, args.dtype, args.op, reps, not args.no_progress
    )
    threads = ""
    if any(d == "cpu" for d in args.devices):
        threads = f", pyddp CPU backend {pyddp._C.CpuBackend().threads} threads"
    where = f"{torch.get_num_threads()} threads"
    if args.devices[0].startswith("cuda"):
        where = "on the device"
    print(
        f"all-reduce ({args.op}, {args.dtype}) over the first N of {args.devices}{threads}; "
        f"references in the same run on {args.devices[0]}: torch copy_ and add_ ({where}), "
        f"and on the host np.copyto (1 thread); {reps} interleaved samples"
    )
    print(
        table(
            [
                "bytes",
                "N",
                "count",
                "time us",
                "p10",
                "p90",
                "algbw GB/s",
                "busbw GB/s",
                "traffic GB/s",
                "copy GB/s",
                "np copy GB/s",
                "algbw/copy",
                "time/add_",
            ],
            [
                [
                    r["bytes"],
                    r["replicas"],
                    r["count"],
                    r["time_s"]["median"] * 1e6,
                    r["time_s"]["p10"] * 1e6,
                    r["time_s"]["p90"] * 1e6,
                    r["algbw_GBps"],
                    r["busbw_GBps"],
                    r["traffic_GBps"],
                    r["copy_GBps"],
                    r["np_copy_GBps"],
                    r["algbw_over_copy"],
                    r["time_over_add"],
                ]
                for r in rows
            ],
        )
    )
    print(
        "algbw = bytes / time; busbw = algbw x 2(N-1)/N (NCCL's convention); traffic = "
        "2 x N x bytes / time\n(the reduction reads N buffers and writes N; a copy reads 1 and "
        "writes 1). GB = 1e9 bytes.\nSmall sizes repeat calls on the same buffers per sample: "
        "they measure per-call cost with the data in cache:\ntime/add_ is that cost over a "
        "torch add_ of the same buffers, the floor any op pays (a kernel launch on a GPU)."
    )
    for r in rows:
        if r["bytes"] == rows[-1]["bytes"]:
            n, ratio = r["replicas"], r["algbw_over_copy"]
            print(
                f"{r['bytes']} bytes, N={n}: algbw {ratio:.2f}x the copy's (1/N = {1 / n:.2f} "
                f"is memory speed), memory traffic {n * ratio:.2f}x the copy's"
            )
    return {"devices": args.devices, "rows": rows}


def _overlap(args: argparse.Namespace) -> Dict[str, Any]:
    size = model_size(args)
    if args.processes > 1:
        chart = _path(args, _result_name(args)).with_suffix(".png")
        return multiproc.command(args, size, chart)
    caps = [float(c) for c in args.caps.split(",") if c]
    # --quick: the tiny model's step takes about a millisecond, so each sample
    # averages several steps; still far too little work to rank the variants.
    rounds, steps = (5, 8) if args.quick else (args.rounds, args.steps)
    result = overlap.run(
        args.model,
        size["width"],
        size["depth"],
        size["batch"],
        args.devices,
        caps,
        rounds,
        steps,
        ddp=not args.no_ddp,
        progress=not args.no_progress,
    )
    rows = []
    for r in result["results"]:
        if r["variant"] == "no reduction":
            versus = "-"
        elif r["within_bound_spread"]:
            versus = "within noise"
        else:
            versus = "above" if r["over_lower_bound"] > 1 else "below"
        rows.append(
            [
                r["variant"],
                r["step_s"]["median"] * 1e3,
                r["step_s"]["p10"] * 1e3,
                r["step_s"]["p90"] * 1e3,
                r["over_lower_bound"],
                versus,
                "-" if r["overlap_fraction"] is None else f"{100 * r['overlap_fraction']:.0f}%",
                "-" if r["exposed_comm_s"] is None else r["exposed_comm_s"] * 1e3,
            ]
        )
    print(
        f"{args.model} width {size['width']} depth {size['depth']}, global batch "
        f"{size['batch']}, on {args.devices}; {rounds} samples of {steps} steps per variant"
    )
    print(
        table(
            [
                "variant",
                "step ms",
                "p10",
                "p90",
                "/lower bound",
                "vs bound",
                "overlap",
                "exposed comm ms",
            ],
            rows,
        )
    )
    print(
        "/lower bound: median step over the median of 'no reduction' (pyddp's hooks, no "
        "reductions),\nmeasured in this run, interleaved, not computed (torch DDP: after the "
        "others, in processes\nof its own). 'within noise': the median lies inside the "
        "bound's p10-p90, so which side of 1\nthe ratio falls on means nothing."
    )
    if not args.no_ddp and len(args.devices) < 2 and args.processes < 2:
        print("torch DDP: not run (one device: nothing to reduce across)")
    _print_gpu_bound(result["results"])
    if args.quick:
        print(
            "--quick: a tiny model whose reductions cost microseconds, and few samples: this "
            "checks\nthat the command runs; do not read its ratios as results."
        )
    print(f"chart {overlap.chart(result, _path(args, 'overlap').with_suffix('.png'))}")
    return result


def _print_gpu_bound(results: List[Dict[str, Any]]) -> None:
    """GPU replicas: each pyddp variant's host and GPU time per backward
    (dm.stats()["gpu"]) and whether the host bounds its step."""
    advice = None
    for r in results:
        for device, g in (r.get("gpu") or {}).items():
            gpu = "-" if g["gpu_ms"] is None else f"{g['gpu_ms']:.2f}"
            waited = g["gpu_waited_for_host"]
            print(
                f"{r['variant']}, {device}: host {g['host_ms']:.2f} ms, GPU {gpu} ms per "
                f"backward; the GPU waited for the host at "
                f"{'-' if waited is None else f'{100 * waited:.0f}%'} of forwards: "
                f"{g['bound'] or '?'}-bound"
            )
        advice = advice or r.get("gpu_advice")
    if advice:
        print(f"host-bound: {advice}")


def _simulate(args: argparse.Namespace) -> Dict[str, Any]:
    return simulator_cli.run(args, _path(args, _result_name(args)).with_suffix(".png"))
