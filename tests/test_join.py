"""dmodel.join() in one process, and its misuse. Across processes (where
ranks run out of inputs) it is tested against torch DDP's Join and the
closed form in tests/test_multiprocess.py (`join`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.join import Joinable

import pyddp


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_a_wrapped_model_is_one_of_torchs_joinables():
    with pyddp.wrap(_model(), ["cpu", "cpu"]) as dm:
        assert isinstance(dm, Joinable)
        assert dm.join_device == torch.device("cpu")
        assert dm.join_process_group is None  # one process: no group


def test_join_in_one_process_changes_nothing():
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    results = []
    for joined in (False, True):
        with pyddp.wrap(_model(), ["cpu", "cpu"]) as dm:
            opt = dm.optimizer(torch.optim.SGD, lr=0.1)
            with dm.join() if joined else torch.enable_grad():
                for _ in range(3):
                    opt.zero_grad()
                    nn.functional.mse_loss(dm(x), y).backward()
                    opt.step()
            results.append([p.detach().clone() for p in dm.module.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"divide_by_initial_world_size": 1},
        {"enable": "yes"},
        {"throw_on_early_termination": None},
    ],
)
def test_join_refuses_non_bool_flags(kwargs):
    with (
        pyddp.wrap(_model(), ["cpu", "cpu"]) as dm,
        pytest.raises(TypeError, match=next(iter(kwargs))),
    ):
        dm.join(**kwargs)


def test_join_hook_needs_processes_and_join_needs_an_open_model():
    dm = pyddp.wrap(_model(), ["cpu", "cpu"])
    with pytest.raises(RuntimeError, match="one process"):
        dm.join_hook()
    dm.close()
    with pytest.raises(RuntimeError, match="closed"):
        dm.join()
