"""fp16 loss scaling's overflow check under sharded gradients
(shard_optimizer="gradients"): each replica holds the reduced gradient in
its own block only, so an overflow in another replica's block must skip the
step and halve the scale on every replica of every process, as it does
unsharded (found: replica 0's buffers alone were checked, the step was
taken and a parameter became -inf). On CPUs through the Trainer's own step,
on simulated GPUs, and across 2 processes."""

from __future__ import annotations

import functools

import pytest
import torch
from spawn import run_alone, spawn
from torch import nn

import pyddp
from pyddp.train.scaler import LossScaler

WIDTH = 64  # one bucket of one parameter: block 0 is [0, 32), block 1 [32, 64)
HOT = 40  # an element of block 1


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum(1)


def _rows(replicas: int, hot_replica: int) -> torch.Tensor:
    """Two rows per replica; replica `hot_replica`'s overflow element HOT."""
    x = torch.full((2 * replicas, WIDTH), 0.5)
    x[2 * hot_replica : 2 * hot_replica + 2, HOT] = 3e38
    return x


def test_an_overflow_in_another_replicas_block_skips_the_trainers_step():
    trainer = pyddp.Trainer(
        _Scale(),
        ["cpu", "cpu"],
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=lambda out, y: out.mean(),
        config=pyddp.TrainConfig(batch_size=4, progress=False, shard_optimizer="gradients"),
    )
    # The Trainer takes fp16 on GPUs only; its loss scaling is device-free.
    trainer._scaler = LossScaler(enabled=True)
    dm = trainer.model
    (dm(_rows(2, hot_replica=1)).mean() * trainer._scaler.scale).backward()
    k = dm._reducer._backend.rank_of(0)
    assert k == 0 and bool(torch.isfinite(dm._reducer._layout.scattered.blocks[0][0]).all())
    before = dm.module.w.detach().clone()
    assert trainer._optimizer_step() is False  # skipped
    assert trainer._scaler.scale == 2.0**15
    assert torch.equal(dm.module.w, before) and torch.equal(dm.replicas[1].w, before)
    # A clean step afterwards is taken, on every replica alike.
    (dm(torch.full((4, WIDTH), 0.5)).mean() * trainer._scaler.scale).backward()
    assert trainer._optimizer_step() is True
    assert bool(torch.isfinite(dm.module.w).all())
    assert torch.equal(dm.module.w, dm.replicas[1].w)
    trainer.close()


def overflow_on_simulated_gpus(devices):
    from simulated import gpu_wrap, streams

    dm = gpu_wrap(_Scale(), devices)
    opt = dm.optimizer(torch.optim.SGD, shard="gradients", lr=0.1)
    for hot in range(len(devices)):
        (dm(_rows(len(devices), hot)).mean() * 2.0**16).backward()
        streams.synchronize_all(devices)
        scaler = LossScaler(enabled=True)
        flats = [dm._reducer.flat_grads(r) for r in range(len(devices))]
        hot_rank = dm._reducer._backend.rank_of(hot)
        assert scaler.unscale_(flats, dm._sharded_finite()) is False, (hot, hot_rank)
        assert scaler.scale == 2.0**15
        opt.zero_grad()
    dm.close()


@pytest.mark.simgpu
@pytest.mark.parametrize("devices", [[0, 1], [1, 0], [0, 0]])
def test_an_overflow_in_another_replicas_block_is_seen_on_simulated_gpus(devices):
    # NCCL (one GPU per replica, in device order or not) and pyddp's kernel
    # (replicas sharing a GPU): the partial norms all-gathered on the devices.
    run_alone(overflow_on_simulated_gpus, devices)


def overflow_across_processes(out: dict) -> None:
    rank = pyddp.rank()
    dm = pyddp.wrap(_Scale(), ["cpu"])
    dm.optimizer(torch.optim.SGD, shard="gradients", lr=0.1)
    x = _rows(2, hot_replica=1)[2 * rank : 2 * rank + 2]  # rank 1's rows overflow
    (dm(x).mean() * 2.0**16).backward()
    scaler = LossScaler(enabled=True)
    out["stepped"] = scaler.unscale_([dm._reducer.flat_grads(0)], dm._sharded_finite())
    out["own_block_finite"] = bool(torch.isfinite(dm._reducer._layout.scattered.blocks[0][0]).all())
    out["scale"] = scaler.scale


@pytest.mark.multiprocess
def test_an_overflow_on_another_rank_skips_the_step_on_every_rank(tmp_path):
    got = spawn(overflow_across_processes, out=tmp_path)
    assert got[0]["own_block_finite"], got  # rank 0 alone would have stepped
    assert [r["stepped"] for r in got] == [False, False], got
    assert [r["scale"] for r in got] == [2.0**15] * 2, got
