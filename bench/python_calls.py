"""Python calls per training step across processes: 2 processes x 1 CPU
replica under torchrun (this script launches it), rank 0 profiled with
cProfile over --steps steps after a warm-up, for pyddp.wrap and torch DDP
on the same model, batch and SGD step (forward, loss, backward, step,
zero_grad). Reports calls per step in all and in pyddp's (or torch DDP's)
own files. Counts, not times: they do not depend on the machine's load.

    python bench/python_calls.py [--steps 200] [--batch 64] [--quick]

Results: bench/results/python_calls.json (python_calls-quick.json with --quick)."""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict

import torch
from torch import nn

MODELS = {"MLP 128x3": (128, 3, False), "MLP 128x3 + BatchNorm": (128, 3, True),
          "MLP 1024x6": (1024, 6, False)}  # fmt: skip


def mlp(width: int, depth: int, bn: bool) -> nn.Module:
    layers: list = []
    for i in range(depth):
        layers += [nn.Linear(64 if i == 0 else width, width)]
        layers += [nn.BatchNorm1d(width)] if bn else []
        layers += [nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def count(engine: str, spec: tuple, batch: int, steps: int) -> Dict[str, float]:
    import torch.distributed as dist

    import pyddp

    torch.manual_seed(0)
    model = mlp(*spec)
    if engine == "pyddp":
        wrapped, own = pyddp.wrap(model), os.sep + "pyddp" + os.sep
    else:
        wrapped = nn.parallel.DistributedDataParallel(model)
        own = os.sep + "torch" + os.sep + "nn" + os.sep + "parallel" + os.sep
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def step() -> None:
        nn.functional.cross_entropy(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(20):
        step()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (prim, total calls, ...)
    every = sum(v[1] for v in stats.values())
    mine = sum(v[1] for k, v in stats.items() if own in k[0])
    if engine == "pyddp":
        wrapped.close()
    return {"calls_per_step": every / steps, "own_calls_per_step": mine / steps}


def rank_main(out: str, batch: int, steps: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = {}
    for name, spec in MODELS.items():
        for engine in ("pyddp", "torch DDP"):
            rows[f"{name} | {engine}"] = count(engine, spec, batch, steps)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import parser, table, write_results

    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="profiled steps per engine and model")
    p.add_argument("--batch", type=int, default=64, help="rows per process")
    args = p.parse_args()
    steps = 20 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               __file__, "--rank-main", out, str(args.batch), str(steps)]  # fmt: skip
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows = json.loads(Path(out).read_text())
    cells = [[k, v["calls_per_step"], v["own_calls_per_step"]] for k, v in rows.items()]
    print(table(["model | engine", "Python calls/step", "in the engine's own files"], cells))
    write_results("python_calls", args, {"rows": rows, "steps": steps})


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--rank-main":
        rank_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
