"""The torch-linked hot path (pyddp._hot) against the Python path, each as a
ratio to torch DDP in the same processes: `pyddp-bench overlap --processes
2` (2 processes x 1 CPU replica; a step is forward, loss, backward and
zero_grad, the optimizer step left out as in `overlap`; pyddp and DDP
interleaved sample by sample), run for each model with PYDDP_HOT=1 and
PYDDP_HOT=0 in turn, `--repeats` times, so both paths see the same machine
state. Reports per model and path the median over runs of each run's
ratio of medians, and the median of the runs' paired p10 and p90.

    python bench/hot_path.py [--repeats 3] [--rounds 40] [--steps 5] [--only MODEL ...] [--quick]

Results: bench/results/hot_path.json (hot_path-quick.json with --quick)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from _common import parser, write_results

MODELS = {
    "MLP 1024x6": ["--model", "mlp", "--width", "1024", "--depth", "6"],
    "MLP 128x3": ["--model", "mlp", "--width", "128", "--depth", "3"],
    "MLP 128x3 + BatchNorm": ["--model", "mlp_bn", "--width", "128", "--depth", "3"],
    "MLP 1024x6 + BatchNorm": ["--model", "mlp_bn", "--width", "1024", "--depth", "6"],
}
PATHS = {"hot": "1", "python": "0"}


def one_run(model: List[str], hot: str, rounds: int, steps: int) -> Dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "pyddp.bench",
            "overlap",
            "--processes",
            "2",
            *model,
            "--rounds",
            str(rounds),
            "--steps",
            str(steps),
            "--no-progress",
            "--out",
            out,
        ]
        env = {**os.environ, "PYDDP_HOT": hot}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
        ratio = json.loads((Path(out) / "overlap-2proc.json").read_text())["ratio"]
    paired = ratio["paired"]
    return {"ratio": ratio["pyddp_over_ddp"], "p10": paired["p10"], "p90": paired["p90"]}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=3, help="runs per model and path")
    p.add_argument("--rounds", type=int, default=40, help="interleaved samples per run")
    p.add_argument("--steps", type=int, default=5, help="steps per sample")
    p.add_argument("--only", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    args = p.parse_args()
    models = {m: MODELS[m] for m in args.only}
    repeats, rounds = (1, 6) if args.quick else (args.repeats, args.rounds)
    runs: Dict[str, Dict[str, List[Dict[str, float]]]] = {
        m: {path: [] for path in PATHS} for m in models
    }
    for rep in range(repeats):
        for model, flags in models.items():
            # Alternate which path goes first, so neither always runs warm.
            order = list(PATHS.items()) if rep % 2 == 0 else list(PATHS.items())[::-1]
            for path, env in order:
                got = one_run(flags, env, rounds, args.steps)
                runs[model][path].append(got)
                print(
                    f"run {rep + 1}/{repeats} {model:24s} {path:6s} pyddp/DDP {got['ratio']:.3f} "
                    f"(paired p10-p90 {got['p10']:.2f}-{got['p90']:.2f})",
                    flush=True,
                )
    table: List[Dict[str, Any]] = []
    print(f"\n{'model':24s} {'path':6s} {'pyddp/DDP (median of runs)':>27s}  runs  paired p10-p90")
    for model in models:
        for path in PATHS:
            rs = runs[model][path]
            row = {
                "model": model,
                "path": path,
                "ratio_median": statistics.median(r["ratio"] for r in rs),
                "ratios": [r["ratio"] for r in rs],
                "p10_median": statistics.median(r["p10"] for r in rs),
                "p90_median": statistics.median(r["p90"] for r in rs),
            }
            table.append(row)
            shown = ", ".join(f"{r:.2f}" for r in row["ratios"])
            print(
                f"{model:24s} {path:6s} {row['ratio_median']:27.3f}  {shown}  "
                f"{row['p10_median']:.2f}-{row['p90_median']:.2f}"
            )
    write_results("hot_path", args, {"rounds": rounds, "steps": args.steps, "rows": table})


if __name__ == "__main__":
    main()
