"""How often a fresh process's first step on several CPU replica threads
computes a float unary op with oneMKL's low-accuracy kernel
(pytorch/pytorch#188792; pyddp/runtime/mkl.py), with and without pyddp's
warm-up. Each trial is a new Python process (the race is on each VML
function's first call in a process); variants take turns, `--jobs` at once
(on a 2-core machine, one at a time raced more often than two):

- `threads`: 4 plain threads, each a Linear then tanh on its rows, at once;
- `threads after warm()`: the same after `pyddp.runtime.mkl.warm()`;
- `wrap x4 without warm()`: `pyddp.wrap` on 4 CPU replicas, its warm-up
  switched off, one forward;
- `wrap x4`: the same as shipped.

A trial is corrupted when any thread's or replica's rows differ from the same
rows computed again on the main thread afterwards (bitwise; equal row counts).

    python bench/mkl_first_calls.py [--trials 100] [--jobs 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List

from tqdm import tqdm

VARIANTS = ("threads", "threads after warm()", "wrap x4 without warm()", "wrap x4")

CHILD = r"""
import sys, threading, torch
from torch import nn
variant = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
x = torch.randn(12, 6)
n = 4
if variant.startswith("threads"):
    if variant == "threads after warm()":
        from pyddp.runtime import mkl
        mkl.warm()
    bar, out = threading.Barrier(n), [None] * n
    def run(r):
        torch.get_num_threads(); torch.set_num_threads(1)  # as pyddp's workers
        bar.wait()
        with torch.no_grad():
            out[r] = model(x[3 * r : 3 * r + 3])
    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    [t.start() for t in threads]; [t.join() for t in threads]
else:
    import pyddp
    from pyddp.runtime import mkl
    if variant == "wrap x4 without warm()":
        mkl._warm = True  # as if it had run
    dm = pyddp.wrap(model, ["cpu"] * n)
    with torch.no_grad():
        y = dm(x)
    out = [y[3 * r : 3 * r + 3] for r in range(n)]
    dm.close()
with torch.no_grad():
    bad = [r for r in range(n) if not torch.equal(out[r], model(x[3 * r : 3 * r + 3]))]
print("corrupted" if bad else "clean")
"""


def trial(variant: str) -> bool:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, variant], capture_output=True, text=True, check=False
    )
    if done.returncode != 0 or done.stdout.strip() not in ("corrupted", "clean"):
        raise RuntimeError(f"trial {variant!r} failed:\n{done.stdout}{done.stderr}")
    return done.stdout.strip() == "corrupted"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=100, help="fresh processes per variant")
    ap.add_argument("--jobs", type=int, default=1, help="processes at once")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    if args.trials < 1 or args.jobs < 1:
        ap.error("--trials and --jobs must be at least 1")
    order = [v for _ in range(args.trials) for v in VARIANTS]  # taking turns
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(tqdm(pool.map(trial, order), total=len(order), desc="trials"))
    counts: Dict[str, List[int]] = {v: [0, 0] for v in VARIANTS}
    for v, bad in zip(order, results):
        counts[v][0] += bad
        counts[v][1] += 1
    for v, (bad, total) in counts.items():
        print(f"{v:24s} {bad:4d} of {total} processes corrupted")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jobs": args.jobs, "counts": counts}, f, indent=1)


if __name__ == "__main__":
    main()
