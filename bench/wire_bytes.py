"""Bytes on the wire per training step, across 2 processes on CPUs (gloo over
the loopback interface): torch DDP, torch DDP with torch's
ZeroRedundancyOptimizer, and pyddp plain, with sharded optimizer state
(`shard=True`, ZeRO stage 1) and with sharded gradients (`shard="gradients"`,
ZeRO stage 2), on the same model (a GPT-2 from transformers, random init,
default config but 2 layers, no download) and the same global batch.

Measured, not computed: the loopback interface's received-bytes counter
(/proc/net/dev, `lo`) read by rank 0 around `--steps` training steps of one
engine at a time (a barrier before and after), so it counts what gloo sent
between the two processes, headers and control messages included (and
anything else using loopback meanwhile: run it on an idle machine). Engines
take turns in interleaved rounds after a warm-up step each; the table gives
each one's median over the rounds, and its ratio to torch DDP.

    python bench/wire_bytes.py [--quick] [--rounds 3] [--steps 2]"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
from _common import header, parser, rotated, summary, table, write_results
from torch import nn

ENGINES = ["torch DDP", "torch DDP + ZeroRedundancyOptimizer", "pyddp", "pyddp shard=True",
           "pyddp shard='gradients'"]  # fmt: skip


def loopback_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def gpt2(quick: bool) -> Tuple[nn.Module, Callable[[nn.Module, Any], torch.Tensor], Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1 if quick else 2, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    if quick:
        config.vocab_size, config.n_embd, config.n_head = 1000, 64, 4
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (4, 16 if quick else 32))

    def loss(m: nn.Module, batch: Any) -> torch.Tensor:
        return m(input_ids=batch, labels=batch).loss

    return model, loss, ids


def engine(name: str, model: nn.Module) -> Tuple[nn.Module, torch.optim.Optimizer]:
    import pyddp

    adam = dict(lr=1e-4)
    if name.startswith("torch"):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = nn.parallel.DistributedDataParallel(model)
        if "Zero" in name:
            return ddp, ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, **adam)
        return ddp, torch.optim.AdamW(ddp.parameters(), **adam)
    shard: Any = {"pyddp": False, "pyddp shard=True": True}.get(name, "gradients")
    dm = pyddp.wrap(model, ["cpu"])
    return dm, dm.optimizer(torch.optim.AdamW, shard=shard, **adam)


def worker(args: Any) -> None:
    import torch.distributed as dist

    import pyddp

    pyddp.init()
    rank = dist.get_rank()
    model, loss_fn, ids = gpt2(args.quick)
    rows = ids.shape[0] // dist.get_world_size()
    batch = ids[rank * rows : (rank + 1) * rows]
    runs = {name: engine(name, copy.deepcopy(model)) for name in ENGINES}

    def step(name: str) -> None:
        m, opt = runs[name]
        opt.zero_grad()
        loss_fn(m, batch).backward()
        opt.step()

    for name in ENGINES:  # warm-up: buckets rebuilt, optimizer state made
        step(name)
    samples: Dict[str, List[float]] = {name: [] for name in ENGINES}
    for k in range(args.rounds):
        for name in rotated(ENGINES, k):
            dist.barrier()
            before = loopback_bytes()
            for _ in range(args.steps):
                step(name)
            dist.barrier()
            samples[name].append((loopback_bytes() - before) / args.steps)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps({"samples": samples, "param_bytes": params}))
    for m, _ in runs.values():
        if hasattr(m, "close"):
            m.close()
    dist.destroy_process_group()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=2, help="steps per engine per round")
    p.add_argument("--worker-out", default=None, help=argparse_hidden())
    args = p.parse_args()
    if args.worker_out is not None:
        worker(args)
        return
    print(header())
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"wire_bytes.{os.getpid()}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", __file__, "--worker-out", str(out),
           "--rounds", str(args.rounds), "--steps", str(args.steps)]  # fmt: skip
    if args.quick:
        cmd.append("--quick")
    subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    got = json.loads(out.read_text())
    out.unlink()
    samples = got["samples"]
    results: Dict[str, Any] = {"param_bytes": got["param_bytes"], "processes": 2}
    base = summary(samples["torch DDP"])["median"]
    rows = []
    for name in ENGINES:
        s = summary(samples[name])
        results[name] = {"bytes_per_step": s, "samples": samples[name]}
        rows.append([name, s["median"] / 2**20, s["p10"] / 2**20, s["p90"] / 2**20,
                     s["median"] / base, s["median"] / got["param_bytes"]])  # fmt: skip
    print(f"parameters: {got['param_bytes'] / 2**20:.1f} MiB; 2 processes, gloo over loopback")
    print(table(["engine", "MiB/step", "p10", "p90", "vs DDP", "vs params"], rows))
    write_results("wire_bytes", args, results)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
