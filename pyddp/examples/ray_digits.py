"""The digits classifier in a Ray Train TorchTrainer on a local Ray cluster,
with pyddp reducing the gradients: `pyddp.ray.prepare_model` in place of
`ray.train.torch.prepare_model` is the only change (`--engine ddp` runs
Ray's own DDP, for comparison).

    python -m pyddp.examples.ray_digits                 # 2 CPU workers
    python -m pyddp.examples.ray_digits --fail-at 2     # a worker dies in epoch 2

A checkpoint is reported every epoch; with --fail-at E, worker 1 exits in
the middle of epoch E on the first attempt, and Ray restarts the workers
from the last checkpoint (FailureConfig(max_failures=1)). The run writes the
final parameters (params.pt) and the median and mean time per step (summary.json)
to --output."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from pyddp.examples import count
from pyddp.examples._trainers import report, step_times
from pyddp.train.files import output_root


def train_loop(config: Dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    import pyddp.ray
    from pyddp.examples._trainers import make_model
    from pyddp.examples.digits import load_digits

    torch.manual_seed(0)
    model = make_model()
    if config["engine"] == "pyddp":
        model = pyddp.ray.prepare_model(model)
    else:
        model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ctx = ray.train.get_context()
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"]
    (xt, yt), _ = load_digits()
    loader = DataLoader(TensorDataset(xt, yt), batch_size=config["batch"], shuffle=True)
    loader = ray.train.torch.prepare_data_loader(loader)  # a DistributedSampler per worker
    marker = Path(config["output"]) / "failed-once"
    times = []
    for epoch in range(start, config["epochs"]):
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            first_attempt = not marker.exists()
            if (
                epoch == config["fail_at"]
                and i == 5
                and ctx.get_world_rank() == 1
                and first_attempt
            ):
                marker.write_text("worker 1 exited here\n")
                os._exit(1)
            t0 = time.perf_counter()
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            times.append(time.perf_counter() - t0)
        metrics = {"epoch": epoch + 1, **step_times(times)}
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if ctx.get_world_rank() == 0:
                state = {"model": model.module.state_dict(),
                         "optimizer": optimizer.state_dict(), "epoch": epoch + 1}  # fmt: skip
                torch.save(state, Path(d) / "state.pt")
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=checkpoint)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="pyddp", help="pyddp (default) or ddp")
    parser.add_argument("--workers", type=count, default=2)
    parser.add_argument("--epochs", type=count, default=3)
    parser.add_argument("--batch", type=count, default=32, help="per worker")
    parser.add_argument("--fail-at", type=int, default=-1, help="epoch where worker 1 dies once")
    parser.add_argument("--output", default=output_root("ray_digits"))
    args = parser.parse_args(argv)

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    out = Path(args.output).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False)
    try:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={
                "engine": args.engine,
                "epochs": args.epochs,
                "batch": args.batch,
                "fail_at": args.fail_at,
                "output": str(out),
            },  # fmt: skip
            torch_config=TorchConfig(backend="gloo"),
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
            run_config=RunConfig(
                storage_path=str(out / "ray"),
                name="digits",
                failure_config=FailureConfig(max_failures=1),
            ),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()
    with result.checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt")
    summary = {
        "engine": args.engine,
        "world": args.workers,
        "epochs": state["epoch"],
        "step_s": result.metrics["step_s"],
        "mean_step_s": result.metrics["mean_step_s"],
        "restarted": (out / "failed-once").exists(),
    }
    report(out, state["model"], summary)
    return summary


if __name__ == "__main__":
    main()
