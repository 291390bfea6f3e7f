"""The digits classifier in a Lightning Trainer, with pyddp reducing the
gradients: `strategy="pyddp"` after `import pyddp.lightning` is the only
change from Lightning's own DDP (`--strategy ddp` runs that, for comparison).

    python -m pyddp.examples.lightning_digits               # 2 CPU processes (its launcher)
    torchrun --nproc-per-node=2 -m pyddp.examples.lightning_digits   # or under torchrun
    python -m pyddp.examples.lightning_digits --strategy ddp  # Lightning's DDP, same seeds

Uses gradient accumulation, clipping by global norm, a validation loop
with `self.log(..., sync_dist=True)` and ModelCheckpoint; `--resume` goes
on from the last checkpoint. Rank 0 writes the final parameters
(params.pt) and the median and mean time per step (summary.json) to --output."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from pyddp.examples import count
from pyddp.examples._trainers import make_model, report, step_times
from pyddp.examples.digits import load_digits
from pyddp.train.files import output_root


class StepTimes:
    """Wall time of each optimizer step's batches (a Lightning callback
    built lazily so importing this module does not need Lightning)."""

    def __init__(self) -> None:
        self.times: List[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def build(lr: float = 0.05):
    import lightning as L

    class Digits(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            out = self(x)
            self.log("valid_loss", F.cross_entropy(out, y), sync_dist=True)
            self.log("valid_acc", (out.argmax(1) == y).float().mean(), sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=lr, momentum=0.9)

    class Data(L.LightningDataModule):
        def __init__(self, batch: int) -> None:
            super().__init__()
            self.batch = batch

        def setup(self, stage: Optional[str] = None) -> None:
            (xt, yt), (xv, yv) = load_digits()
            self.train, self.valid = TensorDataset(xt, yt), TensorDataset(xv, yv)

        def train_dataloader(self) -> DataLoader:
            # Lightning replaces the sampler by a DistributedSampler (shuffled
            # with the seed, reseeded every epoch), as under its own DDP.
            return DataLoader(self.train, batch_size=self.batch, shuffle=True)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(self.valid, batch_size=self.batch)

    class Timer(StepTimes, L.Callback):
        def __init__(self) -> None:
            StepTimes.__init__(self)

    return Digits, Data, Timer


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="pyddp", help="pyddp (default) or ddp")
    parser.add_argument("--devices", type=count, default=2, help="processes (default 2)")
    parser.add_argument("--epochs", type=count, default=3)
    parser.add_argument("--batch", type=count, default=32, help="per process")
    parser.add_argument("--accumulate", type=count, default=2)
    parser.add_argument("--precision", default="32-true", help="32-true or bf16-mixed")
    parser.add_argument("--resume", action="store_true", help="from checkpoints/last.ckpt")
    parser.add_argument(
        "--comm-hook",
        choices=("fp16", "bf16"),
        help="compress gradients on the wire with torch DDP's hook (pyddp only: Lightning's "
        "own DDP strategy registers hooks on CUDA devices only)",
    )
    parser.add_argument("--output", default=output_root("lightning_digits"))
    args = parser.parse_args(argv)

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import pyddp.lightning  # noqa: F401 - registers strategy="pyddp"

    strategy: Any = args.strategy
    if args.comm_hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if args.strategy != "pyddp":
            parser.error("--comm-hook: Lightning's DDP ignores comm hooks on CPU; use pyddp")
        hook = getattr(default_hooks, f"{args.comm_hook}_compress_hook")
        strategy = pyddp.lightning.PyddpStrategy(ddp_comm_hook=hook)
    Digits, Data, Timer = build()
    L.seed_everything(0, workers=True, verbose=False)
    out = Path(args.output)
    timer = Timer()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0,  # by global norm, over every process's reduced gradients
        precision=args.precision,
        callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", save_last=True), timer],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    model = Digits()
    last = out / "checkpoints" / "last.ckpt"
    trainer.fit(model, datamodule=Data(args.batch), ckpt_path=str(last) if args.resume else None)
    summary = {
        "strategy": args.strategy,
        "world": trainer.world_size,
        "steps": trainer.global_step,
        **step_times(timer.times),
        "valid_loss": float(trainer.callback_metrics["valid_loss"]),
        "valid_acc": float(trainer.callback_metrics["valid_acc"]),
    }
    if trainer.is_global_zero:
        report(out, model.state_dict(), summary)
    return summary


if __name__ == "__main__":
    main()
