"""How far the sharded optimizer (shard=True, shard="gradients") is from the
unsharded one with 16-bit parameters, where it is not bit for bit: torch's
CPU kernels round a slice's vectorised body and its tail differently, so a
parameter cut between shards steps differently by a few units in the last
place. float32 is listed as the control (bit for bit). An MLP of odd sizes,
4 steps, 2 and 3 CPU replicas, SGD with momentum and AdamW.

    python bench/zero_16bit.py"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn

import pyddp

OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    (torch.optim.AdamW, dict(lr=1e-3, eps=1e-3)),  # eps: float16's 1e-8 would underflow
]


def train(
    shard: Any, dtype: torch.dtype, n: int, cls: type, kw: Dict[str, Any]
) -> List[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 37), nn.Tanh(), nn.Linear(37, 5)).to(dtype)
    dm = pyddp.wrap(model, ["cpu"] * n)
    opt = dm.optimizer(cls, shard=shard, **kw)
    torch.manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 8, dtype=dtype), torch.randn(8, 5, dtype=dtype)
        opt.zero_grad()
        nn.functional.mse_loss(dm(x), y).backward()
        opt.step()
    dm.close()
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    print("optimizer  dtype     replicas  shard        largest difference (eps of the value)")
    for cls, kw in OPTIMIZERS:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for n in (2, 3):
                plain = train(False, dtype, n, cls, kw)
                for shard in (True, "gradients"):
                    got = train(shard, dtype, n, cls, kw)
                    if all(torch.equal(a, b) for a, b in zip(plain, got)):
                        diff = "bit for bit"
                    else:
                        eps = torch.finfo(dtype).eps
                        rel = max(
                            ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-30))
                            .max()
                            .item()
                            for a, b in zip(got, plain)
                        )
                        diff = f"{rel / eps:.2f}"
                    name = str(dtype).replace("torch.", "")
                    print(f"{cls.__name__:<10} {name:<9} {n:<9} {shard!s:<12} {diff}")


if __name__ == "__main__":
    main()
