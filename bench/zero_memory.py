"""Sharded optimizer state (ZeRO stage 1, `dmodel.optimizer(..., shard=True)`)
and sharded gradients (stage 2, `shard="gradients"`) against the unsharded
optimizer, side by side in one process on CPU replicas: optimizer-state bytes
and gradient-buffer bytes held per replica (between steps, and the peak
during a step: under stage 2 a bucket's buffer lives only from its first
gradient until its block is copied out), and the time of a training step
(forward, backward, AdamW step) as median and p10/p90 over interleaved runs.
Models: a GPT-2 from transformers (random init, default config but 4 layers,
no download; `--gpt2-layers 12`: GPT-2 small) and the digits MLP. Also checks
that all end with the same parameters, bit for bit. `--torch-ddp` adds torch
DDP's gradient memory per replica from its own account (buckets, and the
`.grad` tensors unless gradient_as_bucket_view; ZeroRedundancyOptimizer, stage
1, leaves it as it is).

    python bench/zero_memory.py [--quick] [--replicas 2 4] [--steps 12] [--gpt2-layers 4]
                                [--torch-ddp]"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
from _common import header, parser, rotated, summary, table, write_results
from torch import nn

import pyddp
from pyddp.examples._trainers import make_model
from pyddp.optim.zero import state_bytes

Built = Tuple[nn.Module, Callable[[nn.Module, Any], torch.Tensor], Any]


def gpt2(quick: bool, layers: int = 4) -> Built:
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, seq, rows = (1, 16, 4) if quick else (layers, 64, 8)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, attn_pdrop=0.0, resid_pdrop=0.0,
                                       embd_pdrop=0.0))  # fmt: skip
    ids = torch.randint(0, model.config.vocab_size, (rows, seq))

    def loss(dm: nn.Module, batch: Any) -> torch.Tensor:
        return dm(input_ids=batch, labels=batch).loss

    return model, loss, ids


def digits(quick: bool) -> Tuple[nn.Module, Callable[[nn.Module, Any], torch.Tensor], Any]:
    torch.manual_seed(0)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

    def loss(dm: nn.Module, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(dm(batch[0]), batch[1])

    return make_model(), loss, (x, y)


MODES = [False, True, "gradients"]
NAMES = {False: "unsharded", True: "sharded", "gradients": "sharded_gradients"}


def measure(
    model: nn.Module,
    loss_fn: Any,
    batch: Any,
    replicas: int,
    steps: int,
    modes: List[Any],
    torch_rows: bool = False,
) -> Dict:
    runs = {}
    for shard in modes:
        dm = pyddp.wrap(copy.deepcopy(model), ["cpu"] * replicas)
        opt = dm.optimizer(torch.optim.AdamW, shard=shard, lr=1e-4)
        runs[shard] = (dm, opt)
    times: Dict[Any, List[float]] = {m: [] for m in modes}
    for k in range(steps):
        for shard in rotated(modes, k):
            dm, opt = runs[shard]
            start = time.perf_counter()
            opt.zero_grad()
            loss_fn(dm, batch).backward()
            opt.step()
            if k > 0:  # the first step allocates the state
                times[shard].append(time.perf_counter() - start)
    equal = all(
        torch.equal(p, q)
        for m in modes[1:]
        for p, q in zip(runs[modes[0]][0].module.parameters(), runs[m][0].module.parameters())
    )
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {"replicas": replicas, "param_bytes": params, "equal_bitwise": equal}
    for shard, (dm, opt) in runs.items():
        # Gradient memory: every tensor holding a replica's bucket memory,
        # after the last step; its peak over the run (stage 2 counts its
        # blocks and the transient buckets as they are allocated and freed;
        # the other modes' buckets never change).
        layout = dm._reducer._layout
        grads = [sum(t.numel() * t.element_size() for t in mem) for mem in layout.memory()]
        scattered = layout.scattered
        out[NAMES[shard]] = {
            "state_bytes_per_replica": state_bytes(opt),
            "grad_bytes_per_replica": grads,
            "grad_peak_bytes_per_replica": list(scattered.peak) if scattered else grads,
            "largest_bucket_bytes": max(layout.bucket_bytes()),
            "step_s": summary(times[shard]),
        }
        dm.close()
    if torch_rows:
        out.update(torch_ddp(model, loss_fn, batch))
    return out


def torch_ddp(model: nn.Module, loss_fn: Any, batch: Any) -> Dict[str, Any]:
    """torch DDP's gradient memory per replica, from its own account (its
    buckets, plus the `.grad` tensors unless gradient_as_bucket_view), in
    a process group of one: it does not depend on the number of replicas,
    and ZeroRedundancyOptimizer (stage 1) leaves it as it is."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = {}
    for name, as_view in (("torch_ddp", False), ("torch_ddp_bucket_view", True)):
        ddp = DDP(copy.deepcopy(model), gradient_as_bucket_view=as_view)
        loss_fn(ddp, batch).backward()
        data = ddp._get_ddp_logging_data()
        buckets = sum(int(b) for b in str(data["bucket_sizes"]).split(","))
        grads = sum(p.grad.numel() * p.grad.element_size() for p in ddp.parameters())
        rows[name] = {"grad_bytes_per_replica": [buckets + (0 if as_view else grads)]}
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--gpt2-layers", type=int, default=4, help="12: GPT-2 small")
    p.add_argument("--no-digits", action="store_true", help="GPT-2 only")
    p.add_argument(
        "--modes",
        nargs="+",
        choices=["unsharded", "sharded", "sharded_gradients"],
        default=list(NAMES.values()),
        help="the optimizers to run side by side (fewer: less memory)",
    )
    p.add_argument(
        "--torch-ddp",
        action="store_true",
        help="also torch DDP's gradient memory per replica (its buckets and .grad)",
    )
    args = p.parse_args()
    print(header())
    steps = 3 if args.quick else args.steps
    results: Dict[str, Any] = {}
    rows = []
    models = [("gpt2", lambda q: gpt2(q, args.gpt2_layers))]
    if not args.no_digits:
        models.append(("digits_mlp", digits))
    for name, build in models:
        model, loss_fn, batch = build(args.quick)
        for n in args.replicas:
            modes = [m for m in MODES if NAMES[m] in args.modes]
            r = measure(model, loss_fn, batch, n, steps, modes, args.torch_ddp)
            results[f"{name}_x{n}"] = r
            full = r[NAMES[modes[0]]]
            for mode in modes:
                got = r[NAMES[mode]]
                rows.append([
                    name, n, NAMES[mode], r["param_bytes"] / 2**20,
                    max(got["state_bytes_per_replica"]) / 2**20,
                    max(got["state_bytes_per_replica"]) / max(full["state_bytes_per_replica"]),
                    sum(got["state_bytes_per_replica"]) / 2**20,
                    max(got["grad_bytes_per_replica"]) / 2**20,
                    max(got["grad_peak_bytes_per_replica"]) / 2**20,
                    got["largest_bucket_bytes"] / 2**20,
                    got["step_s"]["median"] * 1e3,
                    got["step_s"]["median"] / full["step_s"]["median"], r["equal_bitwise"],
                ])  # fmt: skip
            for row in ("torch_ddp", "torch_ddp_bucket_view"):
                if row in r:
                    grads = r[row]["grad_bytes_per_replica"][0] / 2**20
                    rows.append([name, n, row, r["param_bytes"] / 2**20, "", "", "", grads,
                                 grads, "", "", "", ""])  # fmt: skip
    print(table(["model", "replicas", "optimizer", "params MiB", "state MiB/replica",
                 "vs first", "state MiB in all", "grads MiB/replica", "peak MiB/replica",
                 "largest bucket MiB",
                 "step ms", "vs first", "bitwise"],
                rows))  # fmt: skip
    write_results("zero_memory", args, results)


if __name__ == "__main__":
    main()
