"""The digits classifier in a Lightning Fabric loop, with pyddp reducing the
gradients: `strategy="pyddp"` after `import pyddp.lightning` is the only
change from Fabric's own DDP (`--strategy ddp` runs that, for comparison).

    python -m pyddp.examples.fabric_digits                      # 2 CPU processes, Fabric's launcher
    torchrun --nproc-per-node=2 -m pyddp.examples.fabric_digits  # or under torchrun

Uses fabric.no_backward_sync for gradient accumulation, fabric.clip_gradients
and fabric.save/fabric.load (`--resume` goes on from state.ckpt). Rank 0
writes the final parameters (params.pt) and the median and mean time per step
(summary.json) to --output."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from pyddp.examples import count
from pyddp.examples._trainers import make_model, report, step_times
from pyddp.examples.digits import load_digits
from pyddp.train.files import output_root


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="pyddp", help="pyddp (default) or ddp")
    parser.add_argument("--devices", type=count, default=2, help="processes (default 2)")
    parser.add_argument("--epochs", type=count, default=3)
    parser.add_argument("--batch", type=count, default=32, help="per process")
    parser.add_argument("--accumulate", type=count, default=2)
    parser.add_argument("--resume", action="store_true", help="from state.ckpt")
    parser.add_argument(
        "--compile",
        metavar="BACKEND",
        help="torch.compile the model with this backend before fabric.setup (Fabric "
        "compiles the strategy's wrapped model again with the same settings)",
    )
    parser.add_argument("--output", default=output_root("fabric_digits"))
    args = parser.parse_args(argv)

    import lightning as L

    import pyddp.lightning  # noqa: F401 - registers strategy="pyddp"

    fabric = L.Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy)
    fabric.launch()
    fabric.seed_everything(0)
    out = Path(args.output)
    (xt, yt), (xv, yv) = load_digits()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.compile:
        model = torch.compile(model, backend=args.compile)
    model, optimizer = fabric.setup(model, optimizer)
    # The sampler's epoch is set here, from the epoch count a resumed run
    # restores (fabric.setup_dataloaders would number epochs from its own
    # count of iterations, which restarts at 0 in a resumed process).
    sampler = DistributedSampler(TensorDataset(xt, yt), fabric.world_size, fabric.global_rank,
                                 shuffle=True, seed=0)  # fmt: skip
    train = DataLoader(TensorDataset(xt, yt), args.batch, sampler=sampler)
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    if args.resume:
        fabric.load(out / "state.ckpt", state)

    times = []
    for epoch in range(state["epoch"], args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(train):
            start = time.perf_counter()
            last = (i + 1) % args.accumulate == 0 or i + 1 == len(train)
            with fabric.no_backward_sync(model, enabled=not last):
                fabric.backward(F.cross_entropy(model(x), y) / args.accumulate)
            if last:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        state["epoch"] = epoch + 1
        fabric.save(out / "state.ckpt", state)

    with torch.no_grad():
        loss = fabric.all_reduce(F.cross_entropy(model(xv), yv), reduce_op="mean")
    summary = {
        "strategy": args.strategy,
        "world": fabric.world_size,
        **step_times(times),
        "valid_loss": float(loss),
    }
    if fabric.is_global_zero:
        report(out, model.state_dict(), summary)
    return summary


if __name__ == "__main__":
    main()
