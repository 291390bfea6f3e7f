"""The classifier example across processes with the Trainer. Run:
torchrun --nproc-per-node=2 -m pyddp.examples.torchrun
(on several machines: torchrun --nnodes=N --nproc-per-node=P
--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT -m pyddp.examples.torchrun).
Every process trains on its slice of each global batch; rank 0 prints and
writes the run folder (checkpoints, metrics); rerunning resumes from it."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import pyddp
from pyddp.examples import count
from pyddp.examples.classifier import make_data
from pyddp.train.files import output_root


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=count, default=1, help="CPU replicas per process")
    parser.add_argument("--epochs", type=count, default=3)
    parser.add_argument(
        "--out",
        default=output_root("torchrun"),
        help="rank 0's run folder (default: torchrun under $PYDDP_OUTPUT, else pyddp-runs/)",
    )
    args = parser.parse_args(argv)

    pyddp.init()  # joins torchrun's group; every rank must run the same script
    data, labels = make_data(10240, 32, 8, seed=0)  # the same on every rank
    model = nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)
    )
    accuracy = lambda out, y: (out.argmax(1) == y).float().mean()  # noqa: E731
    config = pyddp.TrainConfig(
        batch_size=128,  # the global batch, split over every replica of every process
        max_epochs=args.epochs,
        output_dir=args.out,
        checkpoint_every_epochs=1,
        eval_every_epochs=1,
        resume=True,
    )
    with pyddp.Trainer(
        model,
        ["cpu"] * args.replicas,
        optimizer=torch.optim.Adam,
        loss_fn=F.cross_entropy,
        metrics={"accuracy": accuracy},
        config=config,
    ) as trainer:
        trainer.fit((data[:8192], labels[:8192]), (data[8192:], labels[8192:]))
        result = trainer.evaluate((data[8192:], labels[8192:]))
    if pyddp.is_main():
        print(
            f"{pyddp.world()} processes x {args.replicas} replica(s): valid accuracy "
            f"{result['accuracy']:.3f}"
        )


if __name__ == "__main__":
    main()
