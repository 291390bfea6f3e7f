"""What a backward costs when every gradient was given new storage after its
forward (`p.grad.data = ...`, which `.double().float()` also does): each
gradient's hook then copies it into a fresh view of its bucket slice
(pyddp/engine/ending.py reseat). P parameters of 4 elements on 2 CPU
replicas; per P, rounds of an untouched backward and a touched one,
interleaved; the medians (ms), their ratio, and the touched rounds'
p10-p90. The ratio should stay flat as P grows (O(P) work per backward).

    python bench/reseat_cost.py [--sizes 250,1000,2000] [--rounds 9]"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, Tuple

import torch
from torch import nn

import pyddp


class Many(nn.Module):
    def __init__(self, count: int):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(4)) for _ in range(count)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p * x).sum() for p in self.ps)


def backward_ms(count: int, rounds: int) -> dict:
    model = Many(count)
    dm = pyddp.wrap(model, ["cpu", "cpu"])
    opt = dm.optimizer(torch.optim.SGD, lr=0.0)
    x = torch.randn(2, 4)

    def once(touch: bool) -> float:
        loss = dm(x)
        if touch:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.data = p.grad.detach() * 0.5
        start = time.perf_counter()
        loss.backward()
        elapsed = time.perf_counter() - start
        opt.step()
        return elapsed * 1e3

    result = interleaved(once, rounds)
    dm.close()
    return result


def interleaved(once: Callable[[bool], float], rounds: int) -> Dict[str, float]:
    """`once(False)` and `once(True)` (ms each) in interleaved rounds after a
    warm-up (the first steps lay out the buckets): their medians, "off" and
    "on", and the "on" rounds' p10-p90."""
    for _ in range(3):
        once(False)
    off, on = [], []
    for _ in range(rounds):
        off.append(once(False))
        on.append(once(True))
    deciles = statistics.quantiles(on, n=10, method="inclusive")
    return {"off": statistics.median(off), "on": statistics.median(on),
            "p10": deciles[0], "p90": deciles[-1]}  # fmt: skip


def table(doc: str, measure: Callable[[int, int], Dict[str, float]], rounds: int,
          names: Tuple[str, str], digits: int) -> None:  # fmt: skip
    """The command line of a bench that measures `measure(parameters,
    rounds)` per --sizes: a row each, the medians of `names` (off, on),
    their ratio and the on rounds' p10-p90."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--sizes", default="250,1000,2000")
    parser.add_argument("--rounds", type=int, default=rounds)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"parameters  {names[0]} ms  {names[1]} ms  ratio  {names[1]} p10-p90")
    for count in (int(n) for n in args.sizes.split(",")):
        r = measure(count, args.rounds)
        print(
            f"{count:10d}  {r['off']:{len(names[0]) + 3}.{digits}f}  "
            f"{r['on']:{len(names[1]) + 3}.{digits}f}  {r['on'] / r['off']:5.{digits + 1}f}  "
            f"{r['p10']:.{digits}f}-{r['p90']:.{digits}f}"
        )


if __name__ == "__main__":
    table(__doc__, backward_ms, 9, ("untouched", "touched"), 1)
