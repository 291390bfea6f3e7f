"""Gradient compression on a small real task: the digits classifier trained
across 2 processes (torchrun, gloo) by pyddp.wrap, without a hook and with
torch DDP's fp16 and bf16 compression hooks, on the same seeds and batches.
Prints the validation loss and accuracy per epoch for each and writes them
(JSON) with a chart of the loss curves.

    python -m torch.distributed.run --nproc-per-node=2 bench/compression_digits.py [--epochs 30]"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import pyddp
from pyddp.examples._trainers import make_model
from pyddp.examples.digits import load_digits

HOOKS = ("none", "fp16", "bf16")


def train(hook: str, epochs: int, batch: int) -> list:
    (xt, yt), (xv, yv) = load_digits()
    rank, world = pyddp.rank(), pyddp.world()
    torch.manual_seed(0)
    dm = pyddp.wrap(make_model(), ["cpu"])
    if hook != "none":
        dm.register_comm_hook(None, hook)
    opt = torch.optim.SGD(dm.parameters(), lr=0.05, momentum=0.9)
    curve = []
    with dm:
        for epoch in range(epochs):
            order = torch.randperm(len(xt), generator=torch.Generator().manual_seed(epoch))
            for start in range(0, len(order) - batch * world + 1, batch * world):
                rows = order[start + rank * batch : start + (rank + 1) * batch]
                opt.zero_grad()
                F.cross_entropy(dm(xt[rows]), yt[rows]).backward()
                opt.step()
            with torch.no_grad():
                out = dm.module(xv)
            curve.append({"epoch": epoch + 1, "valid_loss": F.cross_entropy(out, yv).item(),
                          "valid_acc": (out.argmax(1) == yv).float().mean().item()})  # fmt: skip
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch", type=int, default=32, help="per process")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = p.parse_args()
    pyddp.init()
    curves = {hook: train(hook, args.epochs, args.batch) for hook in HOOKS}
    if pyddp.rank() == 0:
        print("epoch  " + "  ".join(f"{h:>18}" for h in HOOKS))
        for e in range(args.epochs):
            cells = [f"{curves[h][e]['valid_loss']:.4f} ({curves[h][e]['valid_acc']:.3f})"
                     for h in HOOKS]  # fmt: skip
            print(f"{e + 1:5d}  " + "  ".join(f"{c:>18}" for c in cells))
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compression_digits.json").write_text(
            json.dumps(
                {"world": pyddp.world(), "batch_per_process": args.batch, "curves": curves},
                indent=1,
            )  # fmt: skip
        )
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for h in HOOKS:
            ax.plot([c["epoch"] for c in curves[h]], [c["valid_loss"] for c in curves[h]],
                    label=h)  # fmt: skip
        ax.set_xlabel("epoch")
        ax.set_ylabel("validation loss")
        ax.set_title("digits, 2 processes: compression hooks")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "compression_digits.png", dpi=100)
        print(f"wrote {out}/compression_digits.json and .png")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
