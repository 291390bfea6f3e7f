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

    for _ in range(3):  # (the first steps lay out the buckets)
        once(False)
    plain, touched = [], []
    for _ in range(rounds):
        plain.append(once(False))
        touched.append(once(True))
    dm.close()
    deciles = statistics.quantiles(touched, n=10, method="inclusive")
    return {
        "untouched": statistics.median(plain),
        "touched": statistics.median(touched),
        "p10": deciles[0],
        "p90": deciles[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="250,1000,2000")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("parameters  untouched ms  touched ms  ratio  touched p10-p90")
    for count in (int(n) for n in args.sizes.split(",")):
        r = backward_ms(count, args.rounds)
        print(
            f"{count:10d}  {r['untouched']:12.1f}  {r['touched']:10.1f}  "
            f"{r['touched'] / r['untouched']:5.2f}  {r['p10']:.1f}-{r['p90']:.1f}"
        )


if __name__ == "__main__":
    main()
