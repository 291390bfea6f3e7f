"""A/B of two pyddp builds on a ZeRO stage 2 step (shard="gradients"): an MLP
512x6, 2 CPU replicas in one process, AdamW, batch 64; prints the build's
folder and the median step time in ms over 35 steps. Run it alternately per
build, each from its own folder first on PYTHONPATH (see ab_builds.py for
installing builds with --target; an editable install would shadow them):

    for i in 1 2 3 4 5 6; do for b in /tmp/a /tmp/b; do
      PYTHONPATH=$b python bench/ab_stage2.py; done; done"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

import pyddp


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)])
    dm = pyddp.wrap(model, ["cpu", "cpu"])
    opt = dm.optimizer(torch.optim.AdamW, shard="gradients", lr=1e-3)
    x, y = torch.randn(64, 512), torch.randn(64, 512)
    times = []
    for k in range(40):
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(dm(x), y).backward()
        opt.step()
        if k >= 5:
            times.append(time.perf_counter() - t0)
    print(pyddp.__file__.rsplit("/pyddp/", 1)[0], f"{statistics.median(times) * 1e3:.2f}")


if __name__ == "__main__":
    main()
