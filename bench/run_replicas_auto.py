"""Does run_replicas="auto" (wrap's default) pick well? It times each kind of
work (forward, backward, optimizer step) on threads and in turn over its
first 21 calls, then keeps one way for all; the pick can differ from one
wrap to the next on a noisy machine. Each set builds three fresh wraps of
the same MLP on 2 CPU replicas (AdamW): "auto", "in_turn" and "threads";
each trains --settle untimed steps (auto decides), then the three take
turns in blocks (one untimed step, then --block timed steps; who goes first
rotates each round). Per set: auto's picks and auto's step time over the
better of the two fixed ways (per-round ratios, median). Over the sets: how
often auto came within 5% of the better way.

    python bench/run_replicas_auto.py [--quick] [--sets 6] [--sizes 64,64,64,10]
                                      [--batch 64] [--rounds 20] [--block 5]"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from _common import header, parser, rotated, summary, table, write_results
from step_time import make_batch, make_model
from tqdm import tqdm

import pyddp

WAYS = ("auto", "in_turn", "threads")


def build(way: str, sizes: Sequence[int], batch: int) -> Tuple[Any, Callable[[], None]]:
    x, y = make_batch(sizes, batch)
    dm = pyddp.wrap(make_model(sizes), ["cpu", "cpu"], run_replicas=way)
    opt = dm.optimizer(torch.optim.AdamW, lr=1e-3)

    def step() -> None:
        F.cross_entropy(dm(x), y).backward()
        opt.step()
        opt.zero_grad()

    return dm, step


def one_set(args: Any, sizes: Sequence[int]) -> Dict[str, Any]:
    built = {w: build(w, sizes, args.batch) for w in WAYS}
    for _, step in built.values():
        for _ in range(args.settle):
            step()
    times: Dict[str, List[float]] = {w: [] for w in WAYS}
    ratios: List[float] = []
    for r in range(args.rounds):
        this: Dict[str, float] = {}
        for w in rotated(list(WAYS), r):
            step = built[w][1]
            step()  # untimed: its weights back in cache
            start = time.perf_counter()
            for _ in range(args.block):
                step()
            this[w] = (time.perf_counter() - start) / args.block
            times[w].append(this[w])
        ratios.append(this["auto"] / min(this["in_turn"], this["threads"]))
    picks = built["auto"][0].run_replicas()
    for dm, _ in built.values():
        dm.close()
    return {
        "picks": picks,
        "step_s": {w: summary(t) for w, t in times.items()},
        "auto_over_better": summary(ratios),
    }


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--sets", type=int, default=6, help="fresh wraps of each way")
    p.add_argument("--sizes", default="64,64,64,10", help="MLP layer widths")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--settle", type=int, default=30, help="untimed steps first (auto: 21 decide)")
    p.add_argument("--rounds", type=int, default=20, help="rounds over the three ways")
    p.add_argument("--block", type=int, default=5, help="timed steps per way and round")
    args = p.parse_args()
    if args.quick:
        args.sets, args.sizes, args.rounds, args.block = 1, "16,16,4", 2, 2
    if min(args.sets, args.batch, args.settle, args.rounds, args.block) < 1:
        p.error("--sets, --batch, --settle, --rounds and --block must be at least 1")
    sizes = [int(s) for s in args.sizes.split(",")]
    print(header())
    print(f"MLP {args.sizes}, batch {args.batch}, 2 CPU replicas, AdamW\n")
    sets = [one_set(args, sizes) for _ in tqdm(range(args.sets), desc="sets")]
    rows = []
    for i, s in enumerate(sets):
        med = {w: s["step_s"][w]["median"] * 1e6 for w in WAYS}
        picks = ", ".join(f"{k}: {v}" for k, v in s["picks"].items())
        ratio = s["auto_over_better"]
        rows.append([i, med["auto"], med["in_turn"], med["threads"], ratio["median"], picks])
    heads = ["set", "auto µs", "in_turn µs", "threads µs", "auto/better", "auto's picks"]
    print(table(heads, rows))
    within = sum(s["auto_over_better"]["median"] <= 1.05 for s in sets)
    overall = statistics.median(s["auto_over_better"]["median"] for s in sets)
    print(f"\nauto within 5% of the better way in {within} of {len(sets)} sets; "
          f"median auto/better {overall:.3f}")  # fmt: skip
    write_results(
        "run_replicas_auto",
        args,
        {"sizes": sizes, "batch": args.batch, "sets": sets, "within_5pct": within},
    )


if __name__ == "__main__":
    main()
