"""Where a Fabric step's time goes, pyddp against Fabric's own DDP: the
digits classifier of `pyddp.examples.fabric_digits` (2 CPU processes,
Fabric's launcher, 2 micro-batches per optimizer step under
`fabric.no_backward_sync`, clipping, SGD with momentum), each phase timed on
rank 0: the forward and the backward of a micro-batch that reduces nothing
(`fwd_ns`, `bwd_ns`) and of the synced one (`fwd_s`, `bwd_s`: the wait for
gloo is in it), the clipping, the optimizer step and zero_grad; medians in
µs, then the mean optimizer step (both micro-batches and the rest, after the
first 20). Runs the two strategies in turn, `--repeats` times.

Needs the lightning extra: pip install --no-build-isolation ".[lightning]".

    python bench/fabric_phases.py [--repeats 3] [--epochs 20]"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Dict, List

PHASES = ("fwd_ns", "bwd_ns", "fwd_s", "bwd_s", "clip", "step", "zero")


def run(strategy: str, epochs: int) -> None:
    """One run (in Fabric's launched processes); rank 0 prints its phases as JSON."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import pyddp.lightning  # noqa: F401 - registers strategy="pyddp"
    from pyddp.examples._trainers import make_model
    from pyddp.examples.digits import load_digits

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    (xt, yt), _ = load_digits()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    data = TensorDataset(xt, yt)
    sampler = DistributedSampler(data, 2, fabric.global_rank, shuffle=True, seed=0)
    train = DataLoader(data, 32, sampler=sampler)
    times: Dict[str, List[float]] = {k: [] for k in (*PHASES, "optimizer_step")}
    opened = None
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(train):
            synced = (i + 1) % 2 == 0
            t0 = time.perf_counter()
            opened = t0 if opened is None else opened
            with fabric.no_backward_sync(model, enabled=not synced):
                loss = F.cross_entropy(model(x), y) / 2
                t1 = time.perf_counter()
                fabric.backward(loss)
            t2 = time.perf_counter()
            kind = "s" if synced else "ns"
            times["fwd_" + kind].append(t1 - t0)
            times["bwd_" + kind].append(t2 - t1)
            if synced:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                t3 = time.perf_counter()
                optimizer.step()
                t4 = time.perf_counter()
                optimizer.zero_grad()
                t5 = time.perf_counter()
                times["clip"].append(t3 - t2)
                times["step"].append(t4 - t3)
                times["zero"].append(t5 - t4)
                times["optimizer_step"].append(t5 - opened)
                opened = None
    if fabric.global_rank == 0:
        out = {k: statistics.median(times[k]) * 1e6 for k in PHASES}
        out["optimizer_step_mean"] = statistics.mean(times["optimizer_step"][20:]) * 1e6
        print("PHASES " + json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--run", choices=("pyddp", "ddp"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        run(args.run, args.epochs)
        return
    print("µs        " + " ".join(f"{k:>8s}" for k in (*PHASES, "opt mean")))
    for rep in range(args.repeats):
        for strategy in ("pyddp", "ddp"):
            cmd = [sys.executable, __file__, "--run", strategy, "--epochs", str(args.epochs)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            line = [x for x in done.stdout.splitlines() if x.startswith("PHASES ")]
            if done.returncode != 0 or not line:
                tail = done.stdout[-2000:] + done.stderr[-3000:]
                raise SystemExit(f"{' '.join(cmd)} failed:\n{tail}")
            got = json.loads(line[-1][len("PHASES ") :])
            shown = " ".join(f"{got[k]:8.0f}" for k in (*PHASES, "optimizer_step_mean"))
            print(f"{strategy:6s} {rep + 1}  {shown}", flush=True)


if __name__ == "__main__":
    main()
