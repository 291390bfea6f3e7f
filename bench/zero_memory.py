"""Sharded optimizer state (ZeRO stage 1, `dmodel.optimizer(..., shard=True)`)
against the unsharded optimizer, side by side in one process on CPU replicas:
optimizer-state bytes held per replica, and the time of a training step
(forward, backward, AdamW step) as median and p10/p90 over interleaved runs.
Models: a GPT-2 from transformers (random init, default config but 4 layers,
no download) and the digits MLP. Also checks that both end with the same
parameters, bit for bit.

    python bench/zero_memory.py [--quick] [--replicas 2 4] [--steps 12]"""

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


def gpt2(quick: bool) -> Tuple[nn.Module, Callable[[nn.Module, Any], torch.Tensor], Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    layers, seq, rows = (1, 16, 4) if quick else (4, 64, 8)
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


def measure(model: nn.Module, loss_fn: Any, batch: Any, replicas: int, steps: int) -> Dict:
    runs = {}
    for shard in (False, True):
        dm = pyddp.wrap(copy.deepcopy(model), ["cpu"] * replicas)
        opt = dm.optimizer(torch.optim.AdamW, shard=shard, lr=1e-4)
        runs[shard] = (dm, opt)
    times: Dict[bool, List[float]] = {False: [], True: []}
    for k in range(steps):
        for shard in rotated([False, True], k):
            dm, opt = runs[shard]
            start = time.perf_counter()
            opt.zero_grad()
            loss_fn(dm, batch).backward()
            opt.step()
            if k > 0:  # the first step allocates the state
                times[shard].append(time.perf_counter() - start)
    equal = all(
        torch.equal(p, q)
        for p, q in zip(runs[False][0].module.parameters(), runs[True][0].module.parameters())
    )
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {"replicas": replicas, "param_bytes": params, "equal_bitwise": equal}
    for shard, (dm, opt) in runs.items():
        name = "sharded" if shard else "unsharded"
        per = state_bytes(opt)
        out[name] = {"state_bytes_per_replica": per, "step_s": summary(times[shard])}
        dm.close()
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    print(header())
    steps = 3 if args.quick else args.steps
    results: Dict[str, Any] = {}
    rows = []
    for name, build in (("gpt2", gpt2), ("digits_mlp", digits)):
        model, loss_fn, batch = build(args.quick)
        for n in args.replicas:
            r = measure(model, loss_fn, batch, n, steps)
            results[f"{name}_x{n}"] = r
            full, shard = r["unsharded"], r["sharded"]
            rows.append([
                name, n, r["param_bytes"] / 2**20,
                max(full["state_bytes_per_replica"]) / 2**20,
                max(shard["state_bytes_per_replica"]) / 2**20,
                max(shard["state_bytes_per_replica"]) / max(full["state_bytes_per_replica"]),
                full["step_s"]["median"] * 1e3, shard["step_s"]["median"] * 1e3,
                shard["step_s"]["median"] / full["step_s"]["median"], r["equal_bitwise"],
            ])  # fmt: skip
    print(table(["model", "replicas", "params MiB", "state MiB/replica", "sharded",
                 "ratio", "step ms", "sharded", "ratio", "bitwise"], rows))  # fmt: skip
    write_results("zero_memory", args, results)


if __name__ == "__main__":
    main()
