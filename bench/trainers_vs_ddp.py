"""The trainer examples with pyddp against the same example on that
framework's own DDP: Lightning, Fabric, Accelerate (under torchrun) and Ray
Train, 2 CPU processes each, the digits classifier, same seeds. Each run
reports its median and its mean step time (summary.json; the mean leaves
out the first tenth of the steps); pyddp and DDP runs alternate (which goes
first alternates too), `--repeats` pairs per framework. Reports per
framework the pyddp/DDP ratio of each pair and their median, for both: the
mean is the time training takes; where the example accumulates gradients
(Lightning, Fabric, Accelerate: 2 micro-batches) the steps are two
populations and their median falls between them, jumping from run to run.

Needs the integrations' extras: pip install --no-build-isolation
".[lightning,accelerate,ray]".

    python bench/trainers_vs_ddp.py [--repeats 3] [--epochs 3] [--only lightning fabric]

Results: bench/results/trainers_vs_ddp.json (-quick.json with --quick)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from _common import parser, write_results

# summary.json's statistic: its key in the results
STATS = {"mean_step_s": "mean", "step_s": "median"}

# framework: (command before the flags, the flag choosing the engine)
EXAMPLES = {
    "lightning": ([sys.executable, "-m", "pyddp.examples.lightning_digits"], "--strategy"),
    "fabric": ([sys.executable, "-m", "pyddp.examples.fabric_digits"], "--strategy"),
    "accelerate": (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "-m",
            "pyddp.examples.accelerate_digits",
        ],
        "--engine",
    ),
    "ray": ([sys.executable, "-m", "pyddp.examples.ray_digits"], "--engine"),
}


def one_run(framework: str, engine: str, epochs: int) -> Dict[str, float]:
    """The median and mean step times (s) of one run of the example."""
    command, flag = EXAMPLES[framework]
    with tempfile.TemporaryDirectory() as out:
        cmd = [*command, flag, engine, "--epochs", str(epochs), "--output", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(
                f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        summary = json.loads((Path(out) / "summary.json").read_text())
        return {stat: float(summary[stat]) for stat in STATS}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=3, help="pyddp/DDP pairs per framework")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run")
    p.add_argument("--only", nargs="+", choices=sorted(EXAMPLES), default=list(EXAMPLES))
    args = p.parse_args()
    repeats, epochs = (1, 1) if args.quick else (args.repeats, args.epochs)
    rows: List[Dict[str, Any]] = []
    for framework in args.only:
        pairs = []
        for rep in range(repeats):
            order = ["pyddp", "ddp"] if rep % 2 == 0 else ["ddp", "pyddp"]
            got = {engine: one_run(framework, engine, epochs) for engine in order}
            pairs.append(got)
            shown = "; ".join(
                f"{stat}: pyddp {got['pyddp'][stat] * 1e3:.2f} ms, DDP "
                f"{got['ddp'][stat] * 1e3:.2f} ms, {got['pyddp'][stat] / got['ddp'][stat]:.3f}x"
                for stat in STATS
            )
            print(f"{framework:10s} run {rep + 1}/{repeats}: {shown}", flush=True)
        row: Dict[str, Any] = {"framework": framework, "pairs_s": pairs}
        for stat in STATS:
            ratios = [g["pyddp"][stat] / g["ddp"][stat] for g in pairs]
            row[STATS[stat]] = {"ratios": ratios, "ratio_median": statistics.median(ratios)}
        rows.append(row)
    for stat, key in STATS.items():
        print(f"\n{stat}\n{'framework':10s}  pyddp/DDP median  pairs")
        for r in rows:
            shown = ", ".join(f"{x:.3f}" for x in r[key]["ratios"])
            print(f"{r['framework']:10s}  {r[key]['ratio_median']:16.3f}  {shown}")
    write_results("trainers_vs_ddp", args, {"epochs": epochs, "rows": rows})


if __name__ == "__main__":
    main()
