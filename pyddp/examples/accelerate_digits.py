"""The digits classifier in a Hugging Face Accelerate loop, with pyddp
reducing the gradients: `pyddp.accelerate.prepare(accelerator, ...)` in
place of `accelerator.prepare(...)` is the only change (`--engine ddp` runs
Accelerate's own DDP, for comparison).

    torchrun --nproc-per-node=2 -m pyddp.examples.accelerate_digits
    accelerate launch --multi_gpu --num_processes 2 -m pyddp.examples.accelerate_digits  # GPUs

(On CPUs, `accelerate launch --cpu --num_processes 2` starts one process:
Accelerate runs several CPU processes through MPI; torchrun needs none.)

Uses accelerator.accumulate, accelerator.backward, accelerator.clip_grad_norm_
and save_state/load_state (`--resume` goes on from the last state). Rank 0
writes the final parameters (params.pt) and the median and mean time per step
(summary.json) to --output."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from pyddp.examples import count
from pyddp.examples._trainers import make_model, report, step_times
from pyddp.examples.digits import load_digits
from pyddp.train.files import output_root


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="pyddp", help="pyddp (default) or ddp")
    parser.add_argument("--epochs", type=count, default=3)
    parser.add_argument("--batch", type=count, default=32, help="per process")
    parser.add_argument("--accumulate", type=count, default=2)
    parser.add_argument("--precision", default="no", help="no or bf16")
    parser.add_argument("--comm-hook", default="no", help="no, fp16, bf16 or power_sgd")
    parser.add_argument("--resume", action="store_true", help="from the last saved state")
    parser.add_argument("--output", default=output_root("accelerate_digits"))
    args = parser.parse_args(argv)

    from accelerate import Accelerator
    from accelerate.utils import (
        DataLoaderConfiguration,
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        ProjectConfiguration,
        set_seed,
    )

    import pyddp.accelerate

    out = Path(args.output)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # on CPUs: a gloo group over the processes
        gradient_accumulation_steps=args.accumulate,
        mixed_precision=args.precision,
        project_config=ProjectConfiguration(out, automatic_checkpoint_naming=True),
        # Each epoch's order from the seed and the epoch alone: a resumed run
        # sees the batches an uninterrupted one would.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=[
            DistributedDataParallelKwargs(
                comm_hook=DDPCommunicationHookType(args.comm_hook),
                # PowerSGD: rank-2 factors, compressing from the second step on
                comm_state_option={"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}
                if args.comm_hook == "power_sgd"
                else {},
            )
        ],
    )
    set_seed(0)
    (xt, yt), (xv, yv) = load_digits()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(TensorDataset(xt, yt), batch_size=args.batch, shuffle=True)
    prepare = accelerator.prepare
    if args.engine == "pyddp":
        prepare = lambda *objects: pyddp.accelerate.prepare(accelerator, *objects)  # noqa: E731
    model, optimizer, loader = prepare(model, optimizer, loader)
    start_epoch = 0
    if args.resume:
        accelerator.load_state()  # the newest under checkpoints/
        # One state saved per epoch, checkpoint_0, checkpoint_1, ...: go on
        # from the next epoch, and number the next state after the last.
        start_epoch = len(list((out / "checkpoints").glob("checkpoint_*")))
        accelerator.project_configuration.iteration = start_epoch

    times = []
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            start = time.perf_counter()
            with accelerator.accumulate(model):
                accelerator.backward(F.cross_entropy(model(x), y))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        accelerator.save_state()

    with torch.no_grad():
        logits = model(xv.to(accelerator.device))
        loss = accelerator.reduce(F.cross_entropy(logits.float(), yv), reduction="mean")
    summary = {
        "engine": args.engine,
        "world": accelerator.num_processes,
        **step_times(times),
        "valid_loss": float(loss),
    }
    if accelerator.is_main_process:
        inner = pyddp.accelerate.unwrap(model) if args.engine == "pyddp" else model.module
        report(out, inner.state_dict(), summary)
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
