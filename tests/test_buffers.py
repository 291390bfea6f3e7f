"""Buffers across processes: after a training step every replica of every
rank holds rank 0's buffers bit for bit, whatever their dtype (complex64,
int64 above 2**53, bool, float16 with a signed zero and a subnormal), over
gloo (CPU) and over NCCL on simulated GPUs. (In one process the replicas
follow replica 0's: tests/test_replicas_follow.py.)"""

from __future__ import annotations

import os
from typing import List

import pytest
import torch
from ranks import maybe_simulated_gpus, wrap_on
from spawn import spawn
from torch import nn

import pyddp


class _EveryDtype(nn.Module):
    """Buffers of the types models register beside float32: rotary
    position factors as complex64 (torchtitan's freqs_cis), int64 counters
    above 2**53, bool masks, float16 with a signed zero and a subnormal."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)
        for name, value in self.values(0).items():
            self.register_buffer(name, value)

    @staticmethod
    def values(rank: int) -> dict:
        tiny = [-0.0 if rank == 0 else 0.0, 6e-8 * (rank + 1), 1.0]
        return {
            "freqs_cis": torch.polar(torch.ones(3), torch.arange(3.0) + rank),
            "big": torch.tensor([2**53 + 1 + rank, -(2**62) + 3], dtype=torch.int64),
            "mask": torch.tensor([True, rank % 2 == 1, False]),
            "tiny": torch.tensor(tiny, dtype=torch.float16),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.freqs_cis.real[1]


def _bits(t: torch.Tensor) -> List[int]:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).tolist()


def buffers_every_dtype(out: dict) -> None:
    """After a training step every replica of every rank holds rank 0's
    buffers bit for bit, whatever their dtype (SCENARIO_REPLICAS replicas
    each; on simulated GPUs with spawn(..., simgpu=True))."""
    replicas = int(os.environ.get("SCENARIO_REPLICAS", "1"))
    gpus, settle = maybe_simulated_gpus(replicas)
    rank = pyddp.rank()
    want = [_bits(b) for b in _EveryDtype().buffers()]
    dm = wrap_on(_EveryDtype(), replicas, gpus)
    with torch.no_grad():  # each rank's own values now (wrap gave every rank rank 0's)
        for m in dm.replicas:
            for name, value in _EveryDtype.values(rank).items():
                getattr(m, name).copy_(value)
    settle()
    out["before"] = [[_bits(b) for b in m.buffers()] == want for m in dm.replicas]
    dm(torch.ones(2, 4)).sum().backward()
    settle()
    out["after"] = [[_bits(b) for b in m.buffers()] == want for m in dm.replicas]
    dm.close()
    if gpus:
        out["violations"] = gpus[1].sim.violations()


@pytest.mark.multiprocess
@pytest.mark.parametrize("replicas", [1, 2])
def test_buffers_of_every_dtype_are_rank_zeros_bit_for_bit(tmp_path, replicas):
    # complex64 (rotary freqs_cis), int64 above 2**53, bool, float16 with a
    # signed zero and a subnormal: every replica of every rank ends up with
    # rank 0's after a training step (before it, rank 1's differ).
    env = {"SCENARIO_REPLICAS": str(replicas)}
    r0, r1 = spawn(buffers_every_dtype, env=env, out=tmp_path)
    assert r0["before"] == [True] * replicas and r1["before"] == [False] * replicas
    assert r0["after"] == r1["after"] == [True] * replicas, (r0, r1)


@pytest.mark.simgpu
@pytest.mark.parametrize("local", [1, 2])
def test_buffers_of_every_dtype_through_nccl_bit_for_bit(tmp_path, local):
    # The device buffer broadcast (2 processes x `local` GPUs): complex64,
    # int64 above 2**53, bool and float16 buffers arrive as rank 0's, bit for
    # bit, on every GPU; every part it sums lies on its own GPU.
    env = {"SCENARIO_REPLICAS": str(local)}
    r0, r1 = spawn(buffers_every_dtype, env=env, simgpu=True, out=tmp_path)
    assert r1["before"] == [False] * local
    assert r0["after"] == r1["after"] == [True] * local, (r0, r1)
    assert not r0["violations"] and not r1["violations"], (r0["violations"], r1["violations"])
