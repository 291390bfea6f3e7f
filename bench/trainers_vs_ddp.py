"""The trainer examples with pyddp against the same example on that
framework's own DDP: Lightning, Fabric, Accelerate (under torchrun) and Ray
Train, 2 CPU processes each, the digits classifier, same seeds. Each run
reports its median step time (summary.json); pyddp and DDP runs alternate
(which goes first alternates too), `--repeats` pairs per framework. Reports
per framework the pyddp/DDP ratio of each pair and their median.

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


def one_run(framework: str, engine: str, epochs: int) -> float:
    """The median step time (s) of one run of the example."""
    command, flag = EXAMPLES[framework]
    with tempfile.TemporaryDirectory() as out:
        cmd = [*command, flag, engine, "--epochs", str(epochs), "--output", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(
                f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return float(json.loads((Path(out) / "summary.json").read_text())["step_s"])


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
            print(
                f"{framework:10s} run {rep + 1}/{repeats}: pyddp {got['pyddp'] * 1e3:.2f} ms, "
                f"DDP {got['ddp'] * 1e3:.2f} ms, {got['pyddp'] / got['ddp']:.3f}x",
                flush=True,
            )
        ratios = [g["pyddp"] / g["ddp"] for g in pairs]
        rows.append(
            {
                "framework": framework,
                "pairs_s": pairs,
                "ratios": ratios,
                "ratio_median": statistics.median(ratios),
            }
        )
    print(f"\n{'framework':10s}  pyddp/DDP median  pairs")
    for r in rows:
        shown = ", ".join(f"{x:.3f}" for x in r["ratios"])
        print(f"{r['framework']:10s}  {r['ratio_median']:16.3f}  {shown}")
    write_results("trainers_vs_ddp", args, {"epochs": epochs, "rows": rows})


if __name__ == "__main__":
    main()
