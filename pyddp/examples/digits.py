"""The main job: train a classifier on scikit-learn's bundled digits (no
download) with pyddp.Trainer on every GPU, or on 2 CPU replicas; write
checkpoints, metrics and a learning-curve PNG to an output folder.

    python -m pyddp.examples.digits [--output pyddp-runs/digits] [--epochs 40]"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import pyddp
from pyddp.examples import check_devices, count, device
from pyddp.train.files import SafeDir, output_root


def load_digits(seed: int = 0):
    from sklearn.datasets import load_digits as sk_digits

    data = sk_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0  # pixels are 0..16
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(256, 128),
        nn.GELU(),
        nn.Linear(128, 10),
    )


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(1) == targets).float().mean()


def plot(history: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(epochs, [h.get("train_loss") for h in history], label="train loss")
    left.plot(epochs, [h["valid_loss"] for h in history], label="valid loss")
    left.plot(epochs, [h["smoothed_valid_loss"] for h in history], "--", label="smoothed valid")
    left.set_xlabel("epoch")
    left.set_yscale("log")
    left.legend()
    right.plot(epochs, [h["accuracy"] for h in history], color="C2")
    right.set_xlabel("epoch")
    right.set_ylabel("valid accuracy")
    right.grid(alpha=0.3)
    fig.suptitle("pyddp: digits")
    fig.tight_layout()
    # Through pyddp's file rules: never through a link planted at that name.
    with SafeDir.open(path.parent) as folder:
        folder.write_atomic(path.name, lambda f: fig.savefig(f, dpi=110, format="png"))
    plt.close(fig)


class _Finished(pyddp.Callback):
    """Why the run resumed from the output folder had already stopped (None
    for a run that trains): the Trainer has judged it when training starts."""

    reason: Optional[str] = None

    def on_train_start(self, trainer: Any) -> None:
        self.reason = trainer.state.stop_reason


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    # The docstring's first paragraph, whole (argparse reflows it).
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output",
        default=output_root("digits"),
        help="output folder (default: digits under $PYDDP_OUTPUT, else under pyddp-runs/)",
    )
    parser.add_argument(
        "--devices", nargs="+", type=device, default=None, help="default: all GPUs, else cpu cpu"
    )
    parser.add_argument("--epochs", type=count, default=40)
    parser.add_argument("--batch", type=count, default=64)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    check_devices(parser, args.devices)

    train, valid = load_digits()
    config = pyddp.TrainConfig(
        batch_size=args.batch,
        max_epochs=args.epochs,
        output_dir=args.output,
        early_stopping_patience=8,
        progress=not args.no_progress,
        max_to_keep=2,
        scheduler_interval="epoch",
    )
    torch.manual_seed(config.seed)
    finished = _Finished()
    trainer = pyddp.Trainer(
        make_model(),
        args.devices,
        optimizer=functools.partial(torch.optim.AdamW, lr=2e-3, weight_decay=1e-4),
        loss_fn=F.cross_entropy,
        scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs),
        metrics={"accuracy": accuracy},
        config=config,
        callbacks=[finished],
    )
    devices = ", ".join(str(d) for d in trainer.model.devices)
    print(
        f"pyddp {pyddp.__version__}: digits, {len(train[0])} train / {len(valid[0])} valid "
        f"images, replicas on {devices}"
    )
    start = time.perf_counter()
    with trainer:
        result = trainer.fit(train, valid)
    seconds = time.perf_counter() - start
    best = min(result.state.history, key=lambda h: h["smoothed_valid_loss"])
    last = result.state.history[-1]
    out = Path(args.output)
    if finished.reason is not None:
        # Resumed from the newest checkpoint in --output, which had stopped.
        more = ""
        if finished.reason == "max_epochs":  # (its cosine spans its epochs: refused on resume)
            more = (
                f"; to train longer, start fresh that way with more --epochs than "
                f"{args.epochs} (its learning rate follows a cosine over its epochs, which "
                "another --epochs changes: this run cannot go on with it)"
            )
        print(
            f"this run had already finished in {out}/ ({finished.reason} after epoch "
            f"{result.state.epoch}): nothing more to train, the results below are its own. To "
            f"start fresh, remove {out}/ or pass --output with another folder{more}"
        )
    plot(result.state.history, out / "learning_curve.png")
    print(
        f"stopped: {result.stop_reason} after {result.state.epoch} epochs, "
        f"{result.state.step} steps, {seconds:.1f}s"
    )
    print(
        f"valid accuracy: last {last['accuracy']:.4f}, best model (step {best['step']}) "
        f"{best['accuracy']:.4f}"
    )
    print(f"wrote {out}/: checkpoints/, best.pt, metrics.csv, metrics.jsonl, learning_curve.png")
    return {"last": last, "best": best, "seconds": seconds, "stop_reason": result.stop_reason}


if __name__ == "__main__":
    # Stopped by Ctrl-C (its checkpoint written): the shell hears it, as 130.
    sys.exit(130 if main()["stop_reason"] == "interrupted" else 0)
