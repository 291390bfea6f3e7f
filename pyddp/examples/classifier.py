"""Quickstart: train a small classifier with `pyddp.wrap` on 2 CPU replicas and
print the loss as it falls. Run: python -m pyddp.examples.classifier"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import pyddp
from pyddp.examples import check_devices, count, device


def make_data(n: int, dim: int, classes: int, seed: int):
    """Overlapping Gaussian blobs, one per class, squashed through a fixed
    nonlinearity: a task an MLP learns in a few epochs; no download needed."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g) * 0.5
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.sin(2.0 * (centres[y] + 0.5 * torch.randn(n, dim, generator=g)))
    return x, y


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", nargs="+", type=device, default=None, help="default: cpu cpu")
    parser.add_argument("--epochs", type=count, default=10)
    parser.add_argument("--batch", type=count, default=128)
    args = parser.parse_args(argv)
    check_devices(parser, args.devices)

    torch.manual_seed(0)
    data, labels = make_data(10240, 32, 8, seed=0)
    x, y, xv, yv = data[:8192], labels[:8192], data[8192:], labels[8192:]
    model = nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)
    )
    devices = args.devices or pyddp.default_devices()
    dmodel = pyddp.wrap(model, devices)
    opt = dmodel.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-4)
    print(
        f"pyddp {pyddp.__version__}: {len(dmodel.replicas)} replicas on "
        f"{[str(d) for d in dmodel.devices]}"
    )
    start = time.perf_counter()
    for epoch in range(args.epochs):
        perm = torch.randperm(len(x))
        total = 0.0
        for i in range(0, len(x), args.batch):
            idx = perm[i : i + args.batch]
            # Each replica computes the loss on its own shard; gradients are
            # reduced during backward.
            loss = dmodel.loss(F.cross_entropy, x[idx], y[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
            total += loss.item() * len(idx)
        dmodel.eval()
        with torch.no_grad():
            accuracy = (dmodel(xv).argmax(1) == yv).float().mean().item()
        dmodel.train()
        print(
            f"epoch {epoch + 1:2d}  train loss {total / len(x):.4f}  valid accuracy {accuracy:.3f}"
        )
    print(f"done in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
