"""GPU memory of the sharded optimizer modes, measured with torch's caching
allocator (torch.cuda.max_memory_allocated): a GPT-like model built from
torch's own layers (no download, no transformers needed), AdamW, fp32, on
one GPU. pyddp runs 2 replicas sharing the GPU (each half the batch), so
its figures cover both replicas: unsharded, shard=True (ZeRO stage 1) and
shard="gradients" (stage 2); beside them plain training on the GPU and
torch DDP, and DDP with torch's ZeroRedundancyOptimizer, in a process
group of one (their gradient memory per GPU does not depend on the number
of GPUs; ZeroRedundancyOptimizer's state would divide by it). Also pyddp's
own account of gradient-buffer bytes per replica (between steps and peak).
Peaks are over 2 steps after 2 warm-up steps.

    python bench/zero_memory_gpu.py [--layers 12] [--out FILE]"""

from __future__ import annotations

import argparse
import json
import socket
from typing import Any, Callable, Dict

import torch
import torch.nn.functional as F
from _common import DecoderLM
from torch import nn

import pyddp

VOCAB, WIDTH, HEADS, TOKENS, BATCH = 32000, 768, 12, 256, 8
MIB = 2**20


def GPTLike(layers: int) -> nn.Module:  # noqa: N802 (a model class, by role)
    return DecoderLM(VOCAB, WIDTH, HEADS, layers, TOKENS, head_bias=False)


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def stepper(opt: Any, loss_of: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad()
        loss_of().backward()
        opt.step()

    return step


def measure(step: Callable[[], None]) -> Dict[str, float]:
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    return {
        "peak_MiB": torch.cuda.max_memory_allocated() / MIB,
        "between_steps_MiB": torch.cuda.memory_allocated() / MIB,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    ids = torch.randint(VOCAB, (BATCH, TOKENS), device="cuda")
    target = torch.randint(VOCAB, (BATCH, TOKENS), device="cuda")
    params = sum(q.numel() for q in GPTLike(args.layers).parameters())
    results: Dict[str, Any] = {"params_MiB": params * 4 / MIB, "layers": args.layers}
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, pyddp {pyddp.__version__}")
    print(f"model: {params / 1e6:.1f} M parameters ({params * 4 / MIB:.0f} MiB fp32)")

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        return GPTLike(args.layers).cuda()

    # Plain training on the GPU.
    model = fresh()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    results["plain"] = measure(stepper(opt, lambda: lm_loss(model(ids), target)))
    model = opt = None
    torch.cuda.empty_cache()

    # pyddp, 2 replicas sharing the GPU.
    for shard in (False, True, "gradients"):
        dm = pyddp.wrap(fresh(), ["cuda:0", "cuda:0"])
        opt = dm.optimizer(torch.optim.AdamW, shard=shard, lr=1e-4)
        got = measure(stepper(opt, lambda dm=dm: dm.loss(lm_loss, ids, target)))
        layout = dm._reducer._layout
        held = [sum(t.numel() * t.element_size() for t in m) for m in layout.memory()]
        peak = layout.scattered.peak if layout.scattered is not None else held
        got["grad_buffers_MiB_per_replica"] = max(held) / MIB
        got["grad_buffers_peak_MiB_per_replica"] = max(peak) / MIB
        got["largest_bucket_MiB"] = max(layout.bucket_bytes()) / MIB
        results[f"pyddp_x2_{shard}"] = got
        dm.close()
        dm = opt = None
        torch.cuda.empty_cache()

    # torch DDP (and with ZeroRedundancyOptimizer) in a group of one.
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    for name, zero in (("torch_ddp", False), ("torch_ddp_zero", True)):
        ddp = DDP(fresh(), device_ids=[0])
        opt = (
            ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-4)
            if zero
            else torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        )
        results[name] = measure(stepper(opt, lambda ddp=ddp: lm_loss(ddp(ids), target)))
        ddp = opt = None
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    width = max(len(k) for k in results)
    for key, value in results.items():
        if isinstance(value, dict):
            shown = ", ".join(f"{k} {v:.0f}" for k, v in value.items())
            print(f"{key:<{width}}  {shown}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
