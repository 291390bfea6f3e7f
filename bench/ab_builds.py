"""A/B of two pyddp builds in one run: step_time.py's training steps (the
bare model, `pyddp.wrap(model, ["cpu"])`, and 2 CPU replicas gathered and
with `dm.loss`), timed in two long-lived worker processes, one per build,
taking turns block by block (rotating who goes first, one computing at a
time). For a change that must not cost time (a refactor): the ratio B/A per
configuration, its median over rounds and the p10-p90 of the per-round ratios.

    pip install --no-deps --no-build-isolation --target /tmp/a <old clone>
    pip install --no-deps --no-build-isolation --target /tmp/b .
    python bench/ab_builds.py /tmp/a /tmp/b --bench-a <old clone>/bench [--rounds 20]

Each folder is put first on the worker's PYTHONPATH; an editable install
(a meta-path finder) would shadow it, so the workers refuse to run if
`pyddp` does not come from the folder given."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from statistics import median
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
CONFIGS = ("bare", "wrap 1 cpu", "wrap 2 cpu gathered", "wrap 2 cpu dm.loss")


def worker(sizes: List[int], batch: int, bench: Path) -> None:
    """Reads "config n" lines, answers each with a JSON list of n step times.
    The steps are `bench`'s step_time.py (the build's own clone: its
    _common.py may need that build's pyddp)."""
    import torch

    sys.path.insert(0, str(bench))
    from step_time import bare_step, make_batch, pyddp_step, timed_block

    import pyddp

    x, y = make_batch(sizes, batch)
    steps = {
        "bare": bare_step(sizes, x, y),
        "wrap 1 cpu": pyddp_step(sizes, ["cpu"], x, y, False),
        "wrap 2 cpu gathered": pyddp_step(sizes, ["cpu", "cpu"], x, y, False),
        "wrap 2 cpu dm.loss": pyddp_step(sizes, ["cpu", "cpu"], x, y, True),
    }
    print(json.dumps({"pyddp": pyddp.__file__, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        name, n = line.rsplit(" ", 1)
        print(json.dumps(timed_block(steps[name], int(n))), flush=True)


def start(site: Path, bench: Path, args: argparse.Namespace) -> Any:
    env = dict(os.environ, PYTHONPATH=str(site))
    cmd = [sys.executable, __file__, "--worker", "--sizes", args.sizes, "--batch", str(args.batch)]
    cmd += ["--bench-a", str(bench)]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    hello = json.loads(proc.stdout.readline())
    if not hello["pyddp"].startswith(str(site)):
        proc.kill()
        raise SystemExit(f"{site}: the worker imported pyddp from {hello['pyddp']} (editable?)")
    return proc


def ask(proc: Any, name: str, n: int) -> List[float]:
    proc.stdin.write(f"{name} {n}\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def pct(xs: List[float], q: float) -> float:
    """The q-quantile (a p10 or p90 of per-round ratios); the orchestrator
    imports no pyddp (the builds' workers do), so not bench/_common.summary."""
    if len(xs) < 2:
        return xs[0]
    return statistics.quantiles(xs, n=10, method="inclusive")[round(q * 10) - 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, nargs="?", help="build A (--target folder)")
    p.add_argument("b", type=Path, nargs="?", help="build B (--target folder)")
    p.add_argument("--sizes", default="784,1024,1024,10")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--block", type=int, default=8, help="timed steps per configuration and turn")
    p.add_argument("--bench-a", type=Path, default=HERE, help="bench/ folder of build A's clone")
    p.add_argument("--bench-b", type=Path, default=HERE, help="bench/ folder of build B's clone")
    p.add_argument("--out", type=Path, default=None, help="results JSON")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker([int(s) for s in args.sizes.split(",")], args.batch, args.bench_a)
    if args.a is None or args.b is None:
        p.error("give the two build folders")
    procs = {
        "A": start(args.a.resolve(), args.bench_a, args),
        "B": start(args.b.resolve(), args.bench_b, args),
    }
    times: Dict[str, Dict[str, List[float]]] = {k: {c: [] for c in CONFIGS} for k in procs}
    ratios: Dict[str, List[float]] = {c: [] for c in CONFIGS}
    for r in range(args.rounds):
        for c in CONFIGS:
            medians = {}
            for k in ("A", "B") if r % 2 == 0 else ("B", "A"):
                t = ask(procs[k], c, args.block)
                times[k][c] += t
                medians[k] = median(t)
            ratios[c].append(medians["B"] / medians["A"])
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    rows = {}
    print(f"A = {args.a}, B = {args.b}; {args.rounds} rounds x {args.block} steps, turns rotate")
    print(f"{'configuration':<22} {'A ms':>8} {'B ms':>8} {'B/A':>6} {'B/A p10-p90 by round':>22}")
    for c in CONFIGS:
        a, b = median(times["A"][c]) * 1e3, median(times["B"][c]) * 1e3
        ra = ratios[c]
        rows[c] = {
            "a_ms": a,
            "b_ms": b,
            "ratio": median(ra),
            "p10": pct(ra, 0.1),
            "p90": pct(ra, 0.9),
        }
        print(
            f"{c:<22} {a:8.2f} {b:8.2f} {median(ra):6.3f} {pct(ra, 0.1):>12.3f}-{pct(ra, 0.9):.3f}"
        )
    if args.out:
        args.out.write_text(
            json.dumps({"a": str(args.a), "b": str(args.b), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
