"""What watching a no_sync() window costs: with several replicas in one
process, pyddp records replica 0's buckets at each window backward's end
and checks them at the next backward's start (pyddp/engine/ending.py
Window.check: a change to the model's gradients inside the window is
refused). P parameters of 4 elements on 2 CPU replicas; per P, rounds of a
window's second micro-batch (forward and backward under no_sync()) with the watch
and with it switched off, interleaved; the medians (ms), their ratio, and
the watched rounds' p10-p90.

    python bench/window_check_cost.py [--sizes 250,1000,2000] [--rounds 15]"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch
from reseat_cost import Many

import pyddp
from pyddp.engine import ending


class _Unwatched:
    """Window's record of a backward's end, switched off."""

    def __init__(self, layout: object) -> None:
        pass


def micro_batch_ms(count: int, rounds: int) -> dict:
    model = Many(count)
    dm = pyddp.wrap(model, ["cpu", "cpu"])
    opt = dm.optimizer(torch.optim.SGD, lr=0.0)
    x = torch.randn(2, 4)

    def once(watched: bool) -> float:
        """A window's second micro-batch (its start checks the first's end)."""
        opt.zero_grad()
        off = mock.patch.multiple(ending, _Seen=_Unwatched, follow_changes=lambda *a: None)
        with off if not watched else contextlib.nullcontext(), dm.no_sync():
            dm(x).backward()
            start = time.perf_counter()
            dm(x).backward()
            elapsed = time.perf_counter() - start
        return elapsed * 1e3

    for _ in range(3):  # (the first steps lay out the buckets)
        once(True)
    plain, watched = [], []
    for _ in range(rounds):
        plain.append(once(False))
        watched.append(once(True))
    dm.close()
    deciles = statistics.quantiles(watched, n=10, method="inclusive")
    return {
        "off": statistics.median(plain),
        "on": statistics.median(watched),
        "p10": deciles[0],
        "p90": deciles[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="250,1000,2000")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("parameters  unwatched ms  watched ms  ratio  watched p10-p90")
    for count in (int(n) for n in args.sizes.split(",")):
        r = micro_batch_ms(count, args.rounds)
        print(
            f"{count:10d}  {r['off']:12.2f}  {r['on']:10.2f}  "
            f"{r['on'] / r['off']:5.3f}  {r['p10']:.2f}-{r['p90']:.2f}"
        )


if __name__ == "__main__":
    main()
