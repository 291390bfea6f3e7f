"""Shared by the scenarios that run on several ranks (tests/spawn.py): the
model they train (Net), its data, each rank's rows of a global batch, and the
single-device training they are compared with; each rank's simulated GPUs
for the scenarios that also run there. References are computed in every
process (single-device training on the global batch; torch DDP on the same
split)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import nn

import pyddp

TOL = 1e-6  # float32: sums over shards and processes associate differently


class Net(nn.Module):
    """`rare` is used only for rows whose first feature is > 1 (so on some
    ranks and steps only); `never` is never used; BatchNorm has buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16)
        self.rare = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        mask = x[:, 0] > 1.0
        if bool(mask.any()):
            h = torch.where(mask[:, None], self.rare(h), h)
        return self.out(h)


SGD = dict(lr=0.1, momentum=0.9, weight_decay=1e-3)  # every equivalence scenario's optimizer


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def data(steps: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g))
        for _ in range(steps)
    ]


def my_rows(n: int, rank: int, world: int) -> slice:
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def step_on_rows(dm, opt, x, y, settle: Callable[[], None] = lambda: None) -> None:
    """One training step of this rank's rows of the global batch (x, y):
    `settle` drains simulated GPUs' streams before the host reads what they
    wrote (the optimizer "kernel" runs in stream order)."""
    rows = my_rows(len(x), pyddp.rank(), pyddp.world())
    opt.zero_grad()
    dm.loss(nn.functional.mse_loss, x[rows], y[rows]).backward()
    settle()
    opt.step()
    settle()


def sequence_of(dm) -> int:
    """Control exchanges made so far on dm's control group (header sequence)."""
    from pyddp._link.control import _sequence

    return _sequence.get(tuple(dm._reducer._link.peers.ranks), 0)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def reference(batches, model: Optional[nn.Module] = None) -> nn.Module:
    """Single-device training of `model` (default: eval_norm(net())) on the
    global batches (SGD, mean squared error)."""
    ref = eval_norm(net()) if model is None else model
    opt = torch.optim.SGD(ref.parameters(), **SGD)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    return ref


def eval_norm(model: nn.Module) -> nn.Module:
    # BatchNorm in training mode normalises by the shard's statistics, which
    # no data-parallel scheme reproduces; compare in eval mode (running stats
    # fixed at their initial values) so the gradients are comparable.
    model.norm.eval()
    return model


def side_by_side(ddp, dopt, dm, batches) -> None:
    """torch DDP and pyddp trained step by step on this rank's rows of the
    same global batches (mean-squared error on each rank's own rows)."""
    rank, world = pyddp.rank(), pyddp.world()
    popt = dm.optimizer(torch.optim.SGD, **SGD)
    for xg, yg in batches:
        rows = my_rows(len(xg), rank, world)
        dopt.zero_grad()
        popt.zero_grad()
        nn.functional.mse_loss(ddp(xg[rows]), yg[rows]).backward()
        dopt.step()
        nn.functional.mse_loss(dm(xg[rows]), yg[rows]).backward()
        popt.step()


def simulated_gpus_of_rank(replicas: int) -> Tuple[Any, Any, List[int]]:
    """This rank's replicas on the simulated CUDA driver and NCCL (tests/simgpu),
    one GPU each, numbered across ranks: the simulation, its stream provider
    and the devices."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "simgpu"))
    from simgpu import Sim, SimStreams

    sim = Sim(os.environ["PYDDP_CUDA_LIBRARY"])
    return sim, SimStreams(sim), [pyddp.rank() * replicas + i for i in range(replicas)]


def maybe_simulated_gpus(replicas: int) -> Tuple[Any, Callable[[], None]]:
    """With SCENARIO_SIMGPU set (spawn(..., simgpu=True)): this rank's
    simulated GPUs for wrap_on (devices, streams), and the drain the host
    calls before it reads what their streams wrote. Else: None (CPU), nothing."""
    if not os.environ.get("SCENARIO_SIMGPU"):
        return None, lambda: None
    _, streams, devices = simulated_gpus_of_rank(replicas)
    return (devices, streams), functools.partial(streams.synchronize_all, devices)


def wrap_on(model: nn.Module, replicas: int, gpus: Any = None, **kw: Any) -> Any:
    """pyddp.wrap over `replicas` CPU replicas, or over the simulated GPUs
    `gpus` (devices, streams) when given."""
    from pyddp.engine.streams import simulated_gpus

    place = contextlib.nullcontext() if gpus is None else simulated_gpus(*gpus)
    with place:
        return pyddp.wrap(model, ["cpu"] * replicas, **kw)
